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
  With ``--qad STEPS``: GPTQ rows trained after GPTQ (QAD, block-wise by default).

Each row: measured bits (the transform matrices counted), KL ± SE, PPL, top-1, wall time;
plans also the units they rotate and the online transforms' estimated cost per token
relative to all decoder linears (a dense block product: ``in * B`` multiply-adds per
rotated linear's input, shared by a fused group, against ``in * out`` for the linears).

    .venv/bin/python -m bench rotation [--parts uniform,menu] [--menus MX+H] [--budgets 5.0]
        [--gptq-scores] [--qad STEPS [--qad-lr 5e-4] [--qad-mode block]] [--verify]

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


def _load() -> dict:
    return json.loads(OUT.read_text()) if OUT.is_file() else {"rows": {}}


def _save(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))


def uniform_row(scheme: str, gptq: bool, work: Path) -> dict:
    """Every unit ``scheme`` through the plugin's oneshot, evaluated from disk."""
    from fp4sense.checkpoint.checks import effective_bits
    from fp4sense.diagnosis.units import find_units, model_fingerprint
    from fp4sense.evaluation.evaluate import evaluate_checkpoint
    from fp4sense.inputs.assets import ensure_model
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.quantization.hosts import quantizer
    from fp4sense.quantization.rounded import uniform_plan

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
    e = evaluate_checkpoint(work, base=source, n_windows=16, progress=False, log=log)
    bits = effective_bits(work)
    return {"scheme": scheme, "gptq": gptq, "oneshot_s": round(oneshot_s, 1),
            "units": len(plan.choices), "units_left_bf16": sum(
                1 for c in plan.choices if c.scheme == "BF16"),
            "effective_bits": e["effective_bits"], "transform_bytes": bits["transform_bytes"],
            **{k: e[k] for k in ("kl", "kl_se", "ppl", "top1")}, "folder": relative(work)}


def menu_row(menu_name: str, budget: float, gptq: bool, work: Path,
             gptq_scores: bool = False, qad: dict | None = None) -> dict:
    """``quantize`` of the bundled model with the menu ``menu_name`` at ``budget`` bits
    (``gptq_scores``: planned from the scores after GPTQ, ``--gptq --gptq-scores``;
    ``qad``: DistillSettings' fields, QAD after GPTQ)."""
    from fp4sense.api import quantize_model
    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.quantization.distill import DistillSettings

    t = time.perf_counter()
    r = quantize_model(None, out_dir=work, budget_bits=budget, menu=MENUS[menu_name],
                       scale_search=menu_name not in AS_GIVEN, gptq=gptq,
                       gptq_scores=gptq_scores, distill=DistillSettings(**qad) if qad else None,
                       overwrite=True, progress=False, log=log)
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
            **trained,
            "wall_s": round(time.perf_counter() - t, 1), "schemes": r["plan"]["schemes"],
            "rotated_units": rotated, "units": len(plan["choices"]),
            "transform_macs_over_linear": macs / linear,
            "predicted_kl": r["plan"]["predicted_kl"], "timings": r["timings"],
            **{k: e[k] for k in ("effective_bits", "kl", "kl_se", "ppl", "top1")},
            "folder": relative(work)}


def transform_cost(scheme: str) -> dict:
    """A uniform ``scheme`` plan of the bundled model: rotated units and the online
    transforms' multiply-adds per token over the decoder linears' (a dense block product:
    ``in x B`` per unit, its parts sharing the input, against ``in x out``)."""
    from fp4sense.diagnosis.units import find_units
    from fp4sense.inputs.models import load_model
    from fp4sense.numerics.schemes import get_scheme

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
            ", scores after GPTQ" if r.get("gptq_scores") else "")
        lines.append(f"| {' / '.join(MENUS[r['menu']])} | {r['budget']} | "
                     f"{method} | {r['effective_bits']:.3f} | "
                     f"{r['kl']:.4f} ± {r['kl_se']:.4f} | {r['ppl']:.2f} | {r['top1']:.3f} | "
                     f"{r['rotated_units']} of {r['units']} | "
                     f"{r['transform_macs_over_linear']:.4f} |")
    if isinstance(result.get("verify_vllm"), dict):
        lines += ["", "`fp4sense verify-vllm` (`--verify`): " + ", ".join(
            f"{name} {verdict}" for name, verdict in result["verify_vllm"].items())]
    return "\n".join(lines) + "\n"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default="uniform,menu")
    ap.add_argument("--budgets", default="5.0", help="W4A4 menu budgets (MX: 4.95)")
    ap.add_argument("--menus", default="W4A4+H,MX+H,W4A4,MX", help="the menu part's menus, of "
                    f"{', '.join(MENUS)}")
    ap.add_argument("--work", type=Path, default=RESULTS / ".rotation")
    ap.add_argument("--gptq-scores", action="store_true", help="the menu part plans from "
                    "the scores after GPTQ (quantize --gptq --gptq-scores), GPTQ rows only")
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
    if "menu" in parts:  # the menus with rotations first, then the plain ones
        budgets = [float(x) for x in args.budgets.split(",")]
        order = [m for m in MENUS if "+H" in m] + [m for m in MENUS if "+H" not in m]
        for g in (True,) if args.gptq_scores or args.qad else (True, False):
            for m in [m for m in order if m in menus]:
                for b in budgets if m.startswith("W4A4") else [MX_BUDGET]:
                    name = (f"{m} @ {b}{' + GPTQ' if g else ''}"
                            f"{f' + {args.qad_mode} QAD {args.qad}' if args.qad else ''}"
                            f"{', scores after GPTQ' if args.gptq_scores else ''}")
                    jobs.append((name, menu_row, (m, b, g)))
    if "uniform" in parts:
        jobs += [(f"uniform {s} + GPTQ", uniform_row, (s, True)) for s in ("NVFP4", "NVFP4_H16")]
    menu_extra = {"gptq_scores": args.gptq_scores,
                  "qad": {"steps": args.qad, "lr": args.qad_lr, "mode": args.qad_mode}
                  if args.qad else None}
    for name, fn, fn_args in jobs:
        if name in result["rows"]:
            continue
        log(f"== {name}")
        folder = args.work / name.replace(" ", "").replace("@", "-").replace("+", "_").replace(
            ",", "_")
        t = time.perf_counter()
        row = fn(*fn_args, folder, **(menu_extra if fn is menu_row else {}))
        row["row_s"] = round(time.perf_counter() - t, 1)
        row["command"] = result["command"]
        result["rows"][name] = row
        _save(result)
        log(json.dumps({name: {k: row[k] for k in ("kl", "kl_se", "effective_bits")}}))
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

