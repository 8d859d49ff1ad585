"""Benchmark: should a unit's score be taken after GPTQ?

A plan scores each (unit, scheme) by its estimated damage under round-to-nearest
weights, then GPTQ rounds the planned model. Units that GPTQ repairs well might need
fewer bits than their RTN score says. This measures it on SmolLM2 per protocol.md, for
one menu at a time (searched-scale FP4, FP8_DYNAMIC, BF16):

1. one uniform GPTQ run per quantizing scheme of the menu (llm-compressor's oneshot with
   `SensitivityGuidedModifier` + `GPTQModifier`, the recipe `fp4sense quantize --gptq`
   runs, every unit that scheme, the 32 calibration windows in order), its quantized
   weights saved to the cache;
2. the plan's Fisher estimate (the first 8 calibration windows), with each linear's
   quantized weight read from that run instead of RTN (``analyze(rounded=...)``, as
   `fp4sense quantize --gptq-scores` does): a report of scores after GPTQ;
3. at each budget, the plan from the RTN report and the plan from the after-GPTQ report,
   each run with GPTQ the same way and evaluated in memory (16 evaluation windows; KL,
   PPL, top-1 per protocol; bits from the plan's accounting, which equals the written
   bytes).

With ``--checkpoint``, the after-GPTQ plan is also written as a real checkpoint by
`fp4sense quantize --sensitivity <the after-GPTQ report> --gptq` (with ``--qad-steps``,
and `--distill STEPS --distill-mode block`): llm-compressor's bf16 oneshot, evaluated
from disk per protocol, and with ``--verify`` through `fp4sense verify-vllm`.

Every in-memory oneshot here runs on the float32 model (`fp4sense quantize` loads bfloat16, as
llm-compressor does): bfloat16 matrix products are several times slower than float32
on CPUs without native bfloat16, and this is a comparison of two plans under the same
GPTQ, not a checkpoint. The NVFP4 global scale then comes from a float32 amax, so the
rows are close to, not bit for bit, the checkpoints' (`bench/stack.py`'s plan + GPTQ).

The RTN estimate is `bench/stack.py`'s (its cache's sensitivity.json) when given and it
scores the menu, else computed here. Resumable (``--cache``).
Results: bench/results/gptq_scores_<menu>.{json,md}.

    .venv/bin/python -m bench gptq_scores [--menu weight-only] [--budgets 5.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench import harness
from bench.harness import RESULTS, Done, Session, command

#: the NVFP4 menus with searched scales (as quantize's default); MX without (its rows)
MENUS = {"weight-only": harness.searched(harness.MENUS["weight-only"]),
         "W4A4": harness.searched(harness.MENUS["W4A4"]),
         "MX": harness.MENUS["MX"]}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--menu", default="weight-only", choices=list(MENUS))
    parser.add_argument("--budgets", default="5.0")
    parser.add_argument("--report", type=Path, default=RESULTS / ".stack-cache" /
                        "sensitivity.json", help="the RTN estimate (computed when absent)")
    parser.add_argument("--cache", type=Path, default=RESULTS / ".gptq-scores-cache",
                        help="resumable state, one folder per menu under it")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--qad-steps", type=int, default=0,
                        help="also run the after-GPTQ plan with GPTQ then block-wise QAD "
                             "(this many steps per block, learning rate --qad-lr, 28 "
                             "windows trained and 4 held out, as bench/stack.py's rows)")
    parser.add_argument("--qad-lr", type=float, default=5e-4)
    parser.add_argument("--checkpoint", action="store_true",
                        help="also write the after-GPTQ plan (+ GPTQ, + block QAD with "
                             "--qad-steps) as a bf16 checkpoint with `fp4sense quantize`")
    parser.add_argument("--verify", action="store_true",
                        help="run `fp4sense verify-vllm` on the written checkpoints")


def run(args: argparse.Namespace) -> int:
    out = args.out or RESULTS / f"gptq_scores_{args.menu.replace('-', '_')}.json"

    from fp4sense.diagnosis import SensitivityReport, analyze
    from fp4sense.planning.milp import solve
    from fp4sense.structure.units import model_fingerprint

    menu = MENUS[args.menu]
    quantizing = [s for s in menu if s != "BF16"]
    args.cache = args.cache / args.menu  # a menu's reports and GPTQ runs are its own
    args.cache.mkdir(parents=True, exist_ok=True)
    done = Done(args.cache / "rows.jsonl")
    session = Session()
    model, calib, evalw = session.model, session.calib, session.evalw
    fingerprint = model_fingerprint(model)

    rtn_path = args.report
    if not rtn_path.is_file() or not set(quantizing) <= set(
            SensitivityReport.load(rtn_path, fingerprint).schemes):
        rtn_path = args.cache / "sensitivity-rtn.json"
        if not rtn_path.is_file():
            _, wall_s = session.estimate(quantizing, args.cache / "analysis", rtn_path)
            done.keep({"key": "estimate-rtn", "wall_s": wall_s})
    rtn = SensitivityReport.load(rtn_path, fingerprint)

    # 1. uniform GPTQ, one run per scheme; its quantized weights saved
    after_path = args.cache / "sensitivity-after-gptq.json"
    if not after_path.is_file():
        from safetensors.torch import save_file

        from fp4sense.quantization.rounded import RoundedWeights

        files = {s: args.cache / f"gptq-{s}.safetensors" for s in quantizing}
        for s in quantizing:
            if f"uniform|{s}" in done and files[s].is_file():
                continue
            t = time.perf_counter()
            plan = solve(rtn, budget_bits=16.0, menu=[s], mode="estimated")
            gptq, _ = gptq_model(plan, calib, args.cache / f"plan-uniform-{s}.json")
            save_file({m: gptq.get_submodule(m).weight.detach().contiguous()
                       for u in rtn.units.units for m in u.modules}, files[s])
            del gptq
            done.keep({"key": f"uniform|{s}", "wall_s": round(time.perf_counter() - t, 1)})
        # 2. the estimate with GPTQ's weights
        t = time.perf_counter()
        analyze(model, calib[:8], schemes=quantizing, views=["grid"], modes=["estimated"],
                cache_dir=None, text={"source": "calibration"}, log=print,
                rounded=RoundedWeights(files)).save(after_path)
        done.keep({"key": "estimate-after-gptq", "wall_s": round(time.perf_counter() - t, 1)})
    after = SensitivityReport.load(after_path, fingerprint)

    repair = {}
    for s in quantizing:
        before, now = rtn.unit_scores(s, "estimated"), after.unit_scores(s, "estimated")
        ratios = sorted(now[u] / before[u] for u in before if before[u] > 0)
        repair[s] = {"median": statistics.median(ratios), "min": ratios[0],
                     "max": ratios[-1], "sum_rtn": sum(before.values()),
                     "sum_after_gptq": sum(now.values())}

    # 3. plans from both reports, with GPTQ, evaluated in memory
    from fp4sense.numerics.metrics import compare_models

    rows, written = [], []
    for budget in map(float, args.budgets.split(",")):
        plans = {name: solve(rep, budget_bits=budget, menu=menu, mode="estimated")
                 for name, rep in (("RTN scores", rtn), ("after-GPTQ scores", after))}
        a, b = ({c.unit: c.scheme for c in p.choices} for p in plans.values())
        moved = sum(a[u] != b[u] for u in a)
        runs = [(name, plan, 0) for name, plan in plans.items()]
        if args.qad_steps:
            runs.append(("after-GPTQ scores", plans["after-GPTQ scores"], args.qad_steps))
        for name, plan, qad in runs:
            key = f"{args.menu}|{name}|{budget}" + (f"|block QAD {qad} lr {args.qad_lr:g}"
                                                     if qad else "")
            if key not in done:
                t = time.perf_counter()
                distill = dict(steps=qad, lr=args.qad_lr, windows=28, holdout=4,
                               mode="block") if qad else None
                gptq, record = gptq_model(plan, calib, args.cache / f"plan-{key}.json"
                                          .replace("|", "_").replace(" ", ""), distill)
                c = compare_models(model, gptq, evalw, desc="evaluating").to_dict()
                del gptq
                kept = ("loss_before", "loss_after", "holdout", "time_s")
                extra = {"qad": {"steps": qad, "lr": args.qad_lr,
                                 **{k: record.get(k) for k in kept}}} if qad else {}
                done.keep({"key": key, "bits": plan.bits, "kl": c["kl"], "kl_se": c["kl_se"],
                           "ppl": c["ppl"], "top1": c["top1"], "schemes": plan.schemes(),
                           "predicted_kl": plan.predicted_kl,
                           "wall_s": round(time.perf_counter() - t, 1), **extra})
            rows.append({"menu": args.menu, "scores": name, "budget": budget,
                         "method": "GPTQ + block QAD ({steps} steps per block, lr {lr:g})"
                                   .format(**done[key]["qad"]) if qad else "GPTQ",
                         "units_moved": moved, **done[key]})
        if args.checkpoint:
            qad = args.qad_steps
            key = f"{args.menu}|after-GPTQ scores|{budget}|checkpoint" + (
                f"|block QAD {qad} lr {args.qad_lr:g}" if qad else "")
            folder = args.cache / "checkpoints" / key.replace("|", "_").replace(" ", "")
            if key not in done:
                done.keep(checkpoint_row(key, folder, calib, after_path, menu, budget, qad,
                                         args.qad_lr))
            method = "GPTQ" + (" + block QAD ({steps} steps per block, lr {lr:g})".format(
                **done[key]["qad"]) if qad else "") + ", written bf16 checkpoint"
            rows.append({"menu": args.menu, "scores": "after-GPTQ scores", "budget": budget,
                         "method": method, "units_moved": moved, **done[key]})
            written.append(folder)
    verified = {}
    if args.verify and written:
        from bench.stack import verify

        verified = verify(written, done)
    result = {"command": command("gptq_scores", args.argv),
              "menu": menu, "rtn_report": rtn_path.name, "repair": repair,
              "timings": {k: v["wall_s"] for k, v in done.items() if "|" not in k
                          or k.startswith("uniform|")},
              "rows": rows, "verify_vllm": verified, "caveat": session.caveat}
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


def gptq_model(plan, calib: torch.Tensor, plan_path: Path, distill: dict | None = None):
    """The bundled model in float32 after llm-compressor's oneshot with the plan and GPTQ
    (the recipe of `fp4sense quantize --gptq`, and with ``distill`` the QAD modifier's
    fields, QAD after GPTQ as `--gptq --distill`), its weights fake-quantized once; and
    QAD's record (None without)."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    from fp4sense.checkpoint.loading import bake_weights
    from fp4sense.inputs.assets import ensure_model
    from fp4sense_llmcompressor.driver import calibrated_model
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    plan.save(plan_path)
    recipe = [SensitivityGuidedModifier(plan=str(plan_path)), GPTQModifier()]
    if distill is not None:
        from fp4sense_llmcompressor.distill import QuantizationAwareDistillationModifier

        recipe.append(QuantizationAwareDistillationModifier(**distill))
    model = calibrated_model(str(ensure_model(log=lambda m: None)), calib, recipe,
                             dtype=torch.float32)
    bake_weights(model)
    return model.eval(), recipe[-1].record if distill is not None else None


def checkpoint_row(key: str, folder: Path, calib: torch.Tensor, report: Path,
                   menu: list[str], budget: float, qad_steps: int, qad_lr: float) -> dict:
    """bench/stack.py's checkpoint row (`fp4sense quantize`, written and evaluated from
    disk, 16 windows) of the plan from ``report`` (the after-GPTQ scores), with GPTQ and,
    with ``qad_steps``, block QAD (28 windows trained, 4 held out)."""
    from bench.stack import checkpoint

    settings = argparse.Namespace(steps=qad_steps, lr=qad_lr, lr_4bit=1.0, qad_windows=28,
                                  qad_holdout=4, qad_mode="block")
    item = checkpoint(key, folder, calib, report, settings, budget_bits=budget, menu=menu,
                      gptq=True, qad=bool(qad_steps))
    item["predicted_kl"] = json.loads((folder / "plan.json").read_text())["predicted_kl"]
    return item


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# Scores after GPTQ", "", f"`{result['command']}`", "", result["caveat"],
             "GPTQ ran on the float32 model (see the script's docstring).", "",
             f"Menu: {', '.join(result['menu'])}. GPTQ's repair per scheme (a unit's "
             "estimated score after GPTQ / its RTN score):", "",
             "| scheme | median | min | max | sum RTN | sum after GPTQ |",
             "|---|---|---|---|---|---|"]
    for s, r in result["repair"].items():
        lines.append(f"| {s} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} | "
                     f"{r['sum_rtn']:.4f} | {r['sum_after_gptq']:.4f} |")
    lines += ["", "Plans + GPTQ, evaluated in memory on the float32 model (16 evaluation "
              "windows); rows marked written bf16 checkpoint are `fp4sense quantize`'s "
              "checkpoints, evaluated from disk (16 windows, bits measured from the files):",
              "",
              "| budget | plan from | units moved | then | bits | predicted | KL (± se) | PPL | "
              "top-1 | schemes | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        schemes = ", ".join(f"{k} {v}" for k, v in sorted(r["schemes"].items()))
        lines.append(f"| {r['budget']} | {r['scores']} | {r['units_moved']} | {r['method']} "
                     f"| {r['bits']:.3f} "
                     f"| {r['predicted_kl']:.4f} | {r['kl']:.4f} ± {r['kl_se']:.4f} | "
                     f"{r['ppl']:.2f} | {r['top1']:.3f} | {schemes} | {r['wall_s']:.0f} |")
    lines += ["", "Wall seconds: " + ", ".join(f"{k} {v}" for k, v in result["timings"].items())]
    if result.get("verify_vllm"):
        lines += ["", "verify-vllm: " + ", ".join(f"{k} {v}" for k, v in
                                                  result["verify_vllm"].items())]
    path.write_text("\n".join(lines) + "\n")

