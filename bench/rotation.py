"""Benchmark: block-Hadamard rotated FP4 schemes against the plain ones, as written
checkpoints, per protocol.md (bundled SmolLM2, calibration split, float32 calibration on a
CPU, the first 16 evaluation windows).

Rows (each resumable: a finished row is kept in the results file and skipped):

- ``uniform``: every unit one scheme, round-to-nearest (RTN): NVFP4 vs NVFP4_H16 /
  NVFP4_H64, MXFP4 vs MXFP4_H32 / MXFP4_H64; with GPTQ: MXFP4, MXFP4_H32 (and, last,
  NVFP4, NVFP4_H16) (the plugin's oneshot on a uniform plan, no estimate; SmolLM2's
  576-wide inputs take no 128-wide rotation);
- ``menu``: `quantize` (estimate, plan, searched-scale twins, RTN or GPTQ) with the W4A4
  menu {NVFP4, FP8_DYNAMIC, BF16} with and without {NVFP4_H16, NVFP4_H64}, and the MX
  menu {MXFP4, FP8_DYNAMIC, BF16} with and without {MXFP4_H32, MXFP4_H64}, at the given
  budgets (default 5.0 bits; MX 4.95). With ``--gptq-scores``: GPTQ rows planned from the
  scores after GPTQ (each quantizing scheme rounded by GPTQ once, a rotated one in its
  rotated basis), for example with the menus taken as given ``W4A4+H16s`` {NVFP4_SEARCH,
  NVFP4_H16_SEARCH, FP8_DYNAMIC, BF16} and ``MX+H32`` {MXFP4, MXFP4_H32, FP8_DYNAMIC, BF16}.
  With ``--qad STEPS``: GPTQ rows trained after GPTQ (QAD, block-wise by default). With
  ``--scores FILE``: rows planned from the scores in FILE (the ``sensitivity.json`` an
  earlier row wrote, e.g. its scores after GPTQ: GPTQ's roundings are per scheme, not per
  budget), no estimate; a plan that rotates no unit is the plain menu's plan, so its row
  records the plan and writes no checkpoint.

With ``--model smollm2-moe``: the menu rows on the MoE bench model instead
(``bench/smollm2_moe.py``, the sparse top-6 of 8 variant, built into ``--work``): its
attention output and shared experts may rotate; its routed experts take no rotation
(vLLM's fused MoE applies no input transform), nor do its q/k/v (they add a bias, which
vLLM's transforms do not serve).

Each row: measured bits (the transform matrices counted), KL ± SE, PPL, top-1, wall time;
plans also the units they rotate and the online transforms' estimated cost per token
relative to all decoder linears (a dense block product: ``in * B`` multiply-adds per
rotated linear's input, shared by a fused group, against ``in * out`` for the linears).

    .venv/bin/python -m bench rotation [--parts uniform,menu] [--menus MX+H] [--budgets 5.0]
        [--model smollm2-moe] [--gptq-scores | --scores FILE]
        [--qad STEPS [--qad-lr 5e-4] [--qad-mode block]] [--verify]

Results: bench/results/rotation.json and rotation.md (``--markdown`` rewrites the tables
from the results so far). Run it alone (the oneshots compete for the cores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench import harness
from bench.harness import RESULTS, command, log, relative

OUT = RESULTS / "rotation.json"
# SmolLM2's widths (576, 1536) take 16-, 32- and 64-wide rotations, not 128 (576 = 64 x 9)
UNIFORM = ["NVFP4", "NVFP4_H16", "NVFP4_H64", "MXFP4", "MXFP4_H32", "MXFP4_H64"]
MENUS = {"W4A4": harness.MENUS["W4A4"], "MX": harness.MENUS["MX"], **harness.ROTATED_MENUS}
AS_GIVEN = {"W4A4+H16s", "MX+H32"}  # planned as given: no searched-scale twins added
MX_BUDGET = 4.95
MOE_TOP_K = 6  # the MoE bench model's sparse variant (bench/results/moe.md)
MODELS = {"smollm2": None, "smollm2-moe": f"SmolLM2-MoE top-{MOE_TOP_K}"}


def _load() -> dict:
    return json.loads(OUT.read_text()) if OUT.is_file() else {"rows": {}}


def _save(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))


def uniform_row(scheme: str, gptq: bool, work: Path) -> dict:
    """Every unit ``scheme`` through the plugin's oneshot, evaluated from disk."""
    from fp4sense.checkpoint.checks import effective_bits
    from fp4sense.inputs.assets import ensure_model
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.jobs.evaluate import evaluate_checkpoint
    from fp4sense.quantization.rounded import uniform_plan
    from fp4sense.runtime.hosts import quantizer
    from fp4sense.structure.units import find_units, model_fingerprint

    source = ensure_model(log=lambda m: None)
    model, tok, _ = load_model(source)
    calib = analysis_windows(tok, None, 32, 512)
    units = find_units(model, calib[:1, :16])
    plan = uniform_plan(units, scheme, "SmolLM2-135M-Instruct", model_fingerprint(model),
                        {"dtype": "float32", "stored_dtype": "bfloat16", "window_prefix": []})
    del model
    work.mkdir(parents=True, exist_ok=True)
    plan.save(work / "plan.json")
    t = time.perf_counter()
    quantizer()(str(source), calib, work, plan="plan.json", gptq=gptq)
    oneshot_s = time.perf_counter() - t
    tok.save_pretrained(work)
    e = evaluate_checkpoint(work, base=source, eval_windows=16, progress=False, log=log)
    bits = effective_bits(work)
    return {"scheme": scheme, "gptq": gptq, "oneshot_s": round(oneshot_s, 1),
            "units": len(plan.choices), "units_left_bf16": sum(
                1 for c in plan.choices if c.scheme == "BF16"),
            "effective_bits": e["effective_bits"], "transform_bytes": bits["transform_bytes"],
            **{k: e[k] for k in ("kl", "kl_se", "ppl", "top1")}, "folder": relative(work)}


def unwritten_plan(menu_name: str, budget: float, scores: Path) -> dict | None:
    """The plan from ``scores`` when it rotates no unit (the plain menu's plan: no
    checkpoint to write), else None; planned by quantize's own rules (its objective)."""
    from fp4sense.diagnosis.results import SensitivityReport
    from fp4sense.jobs.quantize_request import Objective
    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.planning.milp import solve

    objective = Objective.parse(menu=MENUS[menu_name], scale_search=menu_name not in AS_GIVEN,
                                budget_bits=budget, budget_bytes=None, kl_target=None,
                                pins=None, sensitivity=scores, sensitivity_mode=None,
                                select_plans=1)
    report = SensitivityReport.load(scores)
    plan = solve(report, menu=objective.menu_for(report)[0], **objective.solver_arguments())
    if any(get_scheme(c.scheme).rotation for c in plan.choices):
        return None
    return {"menu": menu_name, "budget": budget, "gptq": True, "scores_from": relative(scores),
            "written": False, "schemes": plan.schemes(), "rotated_units": 0,
            "units": len(plan.choices), "transform_macs_over_linear": 0.0,
            "predicted_kl": plan.predicted_kl, "bits_theory": plan.bits}


def menu_row(menu_name: str, budget: float, gptq: bool, work: Path,
             gptq_scores: bool = False, qad: dict | None = None,
             scores: Path | None = None, model: Path | None = None) -> dict:
    """``quantize`` of the bundled model with the menu ``menu_name`` at ``budget`` bits
    (``gptq_scores``: planned from the scores after GPTQ, ``--gptq --gptq-scores``;
    ``qad``: DistillSettings' fields, QAD after GPTQ; ``scores``: planned from that
    report, ``--sensitivity``; ``model``: this model's folder instead of the bundled one)."""
    from fp4sense.api import quantize_model
    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.quantization.distill import DistillSettings

    if scores is not None and (row := unwritten_plan(menu_name, budget, scores)):
        return row
    t = time.perf_counter()
    r = quantize_model(str(model) if model else None, out_dir=work, budget_bits=budget,
                       menu=MENUS[menu_name],
                       scale_search=menu_name not in AS_GIVEN, gptq=gptq,
                       gptq_scores=gptq_scores, distill=DistillSettings(**qad) if qad else None,
                       sensitivity=scores, overwrite=True, progress=False, log=log)
    plan = json.loads((work / "plan.json").read_text())
    units = {f"{u['block']}:{u['kind']}": u  # the unit's input width, from the report
             for u in json.loads((work / "sensitivity.json").read_text())["units"]["units"]}
    linear = macs = 0.0
    rotated = 0
    for c in plan["choices"]:
        linear += c["numel"]
        width = get_scheme(c["scheme"]).rotation
        if width:
            rotated += 1
            macs += width * units[c["unit"]]["in_features"]
    e = r["eval"]
    trained = {}
    if qad:
        record = json.loads((work / "distill.json").read_text())
        trained = {"qad": {**qad, **{k: record[k] for k in ("loss_before", "loss_after",
                                                          "time_s", "start")},
                           "rollbacks": len(record["rollbacks"]),
                           "holdout": record.get("holdout")}}
    return {"menu": menu_name, "budget": budget, "gptq": gptq, "gptq_scores": gptq_scores,
            **trained, **({"scores_from": relative(scores)} if scores else {}),
            "wall_s": round(time.perf_counter() - t, 1), "schemes": r["plan"]["schemes"],
            "rotated_units": rotated, "units": len(plan["choices"]),
            "transform_macs_over_linear": macs / linear,
            "predicted_kl": r["plan"]["predicted_kl"], "timings": r["timings"],
            **{k: e[k] for k in ("effective_bits", "kl", "kl_se", "ppl", "top1")},
            "folder": relative(work)}


def moe_model(work: Path) -> Path:
    """The MoE bench model's sparse variant, built into ``work`` once."""
    from bench.smollm2_moe import build

    folder = work / f"smollm2-moe-top{MOE_TOP_K}"
    if not (folder / "config.json").is_file():
        build(folder, MOE_TOP_K)
    return folder


def transform_cost(scheme: str) -> dict:
    """A uniform ``scheme`` plan of the bundled model: rotated units and the online
    transforms' multiply-adds per token over the decoder linears' (a dense block product:
    ``in x B`` per unit, its parts sharing the input, against ``in x out``)."""
    from fp4sense.inputs.models import load_model
    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.structure.units import find_units

    model, _, _ = load_model(None)
    units = find_units(model).units
    width = get_scheme(scheme).rotation
    fit = [u for u in units if u.why_infeasible(scheme) is None]
    macs = sum(width * u.in_features for u in fit)
    return {"scheme": scheme, "rotated_units": len(fit), "units": len(units),
            "rotated_linears": sum(len(u.modules) for u in fit),
            "transform_macs_over_linear": macs / sum(u.numel for u in units)}


def markdown(result: dict) -> str:
    """The results as Markdown tables (bench/results/rotation.md)."""
    rows = result["rows"]
    lines = ["| uniform | RTN: bits | KL (± se) | PPL | top-1 | + GPTQ: KL (± se) |",
             "|---|---|---|---|---|---|"]
    for s in UNIFORM:
        r, g = rows.get(f"uniform {s}"), rows.get(f"uniform {s} + GPTQ")
        if r is None:
            continue
        gptq = f"{g['kl']:.4f} ± {g['kl_se']:.4f}" if g else "not run"
        lines.append(f"| {s} | {r['effective_bits']:.3f} | {r['kl']:.4f} ± {r['kl_se']:.4f} "
                     f"| {r['ppl']:.2f} | {r['top1']:.3f} | {gptq} |")
    lines += ["", "| menu | budget | method | bits | KL (± se) | PPL | top-1 | rotated units "
              "| transform MACs / linear MACs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        if "menu" not in r:
            continue
        method = ("plan + GPTQ" if r["gptq"] else "plan RTN") + (
            f" + {r['qad']['mode']} QAD" if r.get("qad") else "") + (
            ", scores after GPTQ" if r.get("gptq_scores") else "") + (
            f", scores of `{r['scores_from']}`" if r.get("scores_from") else "")
        measured = (f"{r['effective_bits']:.3f} | {r['kl']:.4f} ± {r['kl_se']:.4f} | "
                    f"{r['ppl']:.2f} | {r['top1']:.3f}" if r.get("written", True) else
                    f"{r['bits_theory']:.3f} (plan) | = the plain menu's plan (predicted "
                    f"{r['predicted_kl']:.4f}), not written | |")
        if r.get("model"):
            method += f" ({r['model']})"
        lines.append(f"| {' / '.join(MENUS[r['menu']])} | {r['budget']} | "
                     f"{method} | {measured} | {r['rotated_units']} of {r['units']} | "
                     f"{r['transform_macs_over_linear']:.4f} |")
    if isinstance(result.get("verify_vllm"), dict):
        lines += ["", "`fp4sense verify-vllm` (`--verify`): " + ", ".join(
            f"{name} {verdict}" for name, verdict in result["verify_vllm"].items())]
    if result.get("verify_note"):  # what a FAIL above comes from, as found
        lines += ["", result["verify_note"]]
    return "\n".join(lines) + "\n"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default="uniform,menu")
    ap.add_argument("--budgets", default="5.0", help="W4A4 menu budgets (MX: 4.95)")
    ap.add_argument("--menus", default="W4A4+H,MX+H,W4A4,MX", help="the menu part's menus, of "
                    f"{', '.join(MENUS)}")
    ap.add_argument("--work", type=Path, default=RESULTS / ".rotation")
    ap.add_argument("--gptq-scores", action="store_true", help="the menu part plans from "
                    "the scores after GPTQ (quantize --gptq --gptq-scores), GPTQ rows only")
    ap.add_argument("--model", choices=list(MODELS), default="smollm2", help="the menu "
                    "part's model: the bundled SmolLM2 or the MoE bench model (top-"
                    f"{MOE_TOP_K} of 8 experts)")
    ap.add_argument("--scores", type=Path, metavar="FILE", help="the menu part plans from "
                    "the scores in FILE (an earlier row's sensitivity.json), GPTQ rows only")
    ap.add_argument("--qad", type=int, metavar="STEPS", help="the menu part's GPTQ rows "
                    "also train (QAD after GPTQ) for STEPS steps")
    ap.add_argument("--qad-lr", type=float, default=5e-4, help="QAD learning rate")
    ap.add_argument("--qad-mode", choices=["end-to-end", "block"], default="block")
    ap.add_argument("--verify", action="store_true", help="verify-vllm the rotated rows")
    ap.add_argument("--cost", metavar="SCHEME", help="only record the online transforms' "
                    "cost of a uniform SCHEME plan of the bundled model")
    ap.add_argument("--markdown", action="store_true", help="only write rotation.md from the "
                    "results so far")


def run(args: argparse.Namespace) -> int:
    parts, menus = args.parts.split(","), args.menus.split(",")
    if set(menus) - set(MENUS):
        raise SystemExit(f"python -m bench rotation: --menus: unknown "
                         f"{sorted(set(menus) - set(MENUS))}; choose of {list(MENUS)}")
    result = _load()
    if args.cost:
        result.setdefault("transform_cost", {})[args.cost] = transform_cost(args.cost)
        _save(result)
        print(json.dumps(result["transform_cost"][args.cost]))
        return 0
    if args.markdown:
        (RESULTS / "rotation.md").write_text(markdown(result))
        print(markdown(result))
        return 0
    result["command"] = command("rotation", args.argv)  # the last; every run's in "commands"
    result["commands"] = [c for c in result.get("commands", []) if c != result["command"]] + [
        result["command"]]
    result["threads"] = torch.get_num_threads()
    jobs = []  # the rows the targets need first: a stopped run resumes where it ended
    if "uniform" in parts:
        jobs += [(f"uniform {s}", uniform_row, (s, False)) for s in UNIFORM]
        jobs += [(f"uniform {s} + GPTQ", uniform_row, (s, True)) for s in ("MXFP4", "MXFP4_H32")]
    moe = MODELS[args.model]
    if moe and set(parts) - {"menu", "none"}:
        raise SystemExit("python -m bench rotation: --model smollm2-moe runs the menu part "
                         "only (--parts menu)")
    if "menu" in parts:  # the menus with rotations first, then the plain ones
        budgets = [float(x) for x in args.budgets.split(",")]
        order = [m for m in MENUS if "+H" in m] + [m for m in MENUS if "+H" not in m]
        if args.scores and args.gptq_scores:
            raise SystemExit("python -m bench rotation: --scores gives the scores "
                             "--gptq-scores would estimate: drop one")
        for g in (True,) if args.gptq_scores or args.qad or args.scores else (True, False):
            for m in [m for m in order if m in menus]:
                for b in budgets if m.startswith("W4A4") else [MX_BUDGET]:
                    name = (f"{f'{moe}: ' if moe else ''}{m} @ {b}{' + GPTQ' if g else ''}"
                            f"{f' + {args.qad_mode} QAD {args.qad}' if args.qad else ''}"
                            f"{', scores after GPTQ' if args.gptq_scores else ''}"
                            f"{f', scores of {args.scores.parent.name}' if args.scores else ''}")
                    jobs.append((name, menu_row, (m, b, g)))
    if "uniform" in parts:
        jobs += [(f"uniform {s} + GPTQ", uniform_row, (s, True)) for s in ("NVFP4", "NVFP4_H16")]
    menu_extra = {"gptq_scores": args.gptq_scores,
                  "qad": {"steps": args.qad, "lr": args.qad_lr, "mode": args.qad_mode}
                  if args.qad else None, "scores": args.scores,
                  "model": moe_model(args.work) if moe else None}
    for name, fn, fn_args in jobs:
        if name in result["rows"]:
            continue
        log(f"== {name}")
        folder = args.work / name.replace(" ", "").replace("@", "-").replace("+", "_").replace(
            ",", "_").replace(":", "_")
        t = time.perf_counter()
        row = fn(*fn_args, folder, **(menu_extra if fn is menu_row else {}))
        row["row_s"] = round(time.perf_counter() - t, 1)
        row["command"] = result["command"]
        if moe and fn is menu_row:
            row["model"] = moe
        result["rows"][name] = row
        _save(result)
        log(json.dumps({name: {k: row.get(k) for k in ("kl", "kl_se", "effective_bits")}}))
    if args.verify:
        # the rotated rows whose checkpoints are still on disk and not verified before
        said = result.get("verify_vllm") if isinstance(result.get("verify_vllm"), dict) else {}
        rotated = [RESULTS / r["folder"] for r in result["rows"].values()
                   if ("_H" in r.get("scheme", "") or r.get("rotated_units"))
                   and (RESULTS / r["folder"]).is_dir()
                   and Path(r["folder"]).name not in said]
        verdicts, tail = harness.verify_vllm(rotated)
        result["verify_vllm"] = {**said, **{name: "PASS" if v["passed"] else "FAIL"
                                            for name, v in verdicts.items()}} or tail
        missing = [f.name for f in rotated if f.name not in verdicts]
        if missing:
            result["verify_vllm_stopped"] = {"before": missing, "tail": tail}
    _save(result)
    (RESULTS / "rotation.md").write_text(markdown(result))
    print(markdown(result))
    return 0

