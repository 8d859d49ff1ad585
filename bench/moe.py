"""Benchmark: FP4 plans on a Mixture-of-Experts model with trained weights.

SmolLM2-MoE (``bench/smollm2_moe.py``: the bundled SmolLM2-135M split into a shared expert
and 8 routed experts per block, Qwen2-MoE layout) in two variants: every expert active
(``top_k = 8``, which computes the dense SmolLM2: the figure says how exactly) and a
sparse one (``top_k = 6``). Per protocol.md (float32 on the CPU; sensitivities estimated
on the calibration windows; KL / PPL / top-1 on the first 16 evaluation windows), menu
{NVFP4, FP8_DYNAMIC, BF16}:

- uniform NVFP4 against fp4sense's estimated plans at 4.75, 5.0 and 5.5 bits per weight
  (bits count every expert: what the checkpoint stores), evaluated in memory with
  fp4sense's fake quantization (expert weights bit for bit what llm-compressor writes,
  a test);
- the estimated analysis's wall time and the peak memory of the process that runs it
  (a child process per variant, its own VmHWM);
- routing coverage of the calibration text (tokens per expert, experts under 10% of an
  even share).

    .venv/bin/python -m bench moe [--work DIR]

Results: bench/results/moe.{json,md}. Caveat: SmolLM2's released weights were Q4_1-
quantized before we got them; the MoE is derived from them, not trained as a MoE.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import MENUS, REPO, RESULTS, Judge, child, command, peak_rss_gib, verify_vllm
from bench.smollm2_moe import build, check_dense

BUDGETS = [4.75, 5.0, 5.5]
MENU = MENUS["W4A4"]
VARIANTS = {"all 8 experts active (= dense SmolLM2)": 8, "top-6 of 8 experts": 6}


def analysis_child(folder: str, windows: int, out: str) -> None:
    """One estimated analysis (grid and per-expert views), timed, in this process."""
    from fp4sense.api import analyze_model

    t = time.perf_counter()
    analyze_model(folder, schemes=["NVFP4", "FP8_DYNAMIC"], views=["grid", "experts"],
                  modes=["estimated"], analysis_windows=windows, out_dir=out, cache=False,
                  plots=True, progress=False, log=lambda msg: None)
    print(json.dumps({"wall_s": round(time.perf_counter() - t, 1),
                      "peak_rss_gib": round(peak_rss_gib(), 2)}))


def evaluate_variant(folder: Path, report_path: Path, eval_windows: int) -> dict:
    """Uniform NVFP4 and the plans, in memory, on the protocol's evaluation windows."""
    from fp4sense.api import load_model
    from fp4sense.diagnosis import SensitivityReport
    from fp4sense.inputs.texts import protocol_windows
    from fp4sense.planning.milp import solve

    report = SensitivityReport.load(report_path)
    model, tok, _ = load_model(folder)
    evalw = protocol_windows(tok, "evaluation", eval_windows)
    units = report.units
    # NVFP4 input scales from the calibration text
    run = Judge(model, units, evalw, stats=report.activation_stats)
    by_name = units.by_name()
    total = sum(u.numel for u in units.units)

    def evaluate(plan) -> dict:
        assign = {c.unit: c.scheme for c in plan.choices}
        r = run.row("", assign)
        return {"bits": round(r["bits"], 4), "active_bits": round(plan.active_bits, 4),
                **{k: r[k] for k in ("kl", "kl_se", "ppl", "top1")},
                "expert_schemes": sorted({s for u, s in assign.items()
                                          if by_name[u].experts}),
                "eval_s": r["wall_s"]}

    uniform = solve(report, budget_bits=16.0, menu=["NVFP4"], mode="estimated")
    rows = [{"method": "uniform NVFP4", "budget": None, **evaluate(uniform)}]
    for b in BUDGETS:
        plan = solve(report, budget_bits=b, menu=MENU, mode="estimated")
        rows.append({"method": "fp4sense plan", "budget": b,
                     "predicted_kl": plan.predicted_kl, **evaluate(plan)})
        print(json.dumps(rows[-1]), flush=True)
    return {"base_ppl": run.base_ppl(), "rows": rows,
            "routing": report.routing, "unaccounted": units.unaccounted,
            "expert_share": round(sum(u.numel for u in units.units if u.experts) / total, 3)}


def checkpoint_check(folder: Path, work: Path, scheme: str = "NVFP4",
                     budget: str = "4.6") -> dict:
    """``scheme`` (uniform; or a menu, planned at ``budget`` bits) written by `fp4sense
    quantize` (its evaluation from disk) and served by vLLM (`fp4sense verify-vllm`:
    log-probs against transformers)."""
    fp4sense = str(Path(sys.executable).parent / "fp4sense")
    out = work / f"{folder.name}-{scheme.lower().replace(',', '-')}-{budget}"
    t = time.perf_counter()
    subprocess.run([fp4sense, "quantize", str(folder), "--menu", scheme, "--budget", budget,
                    "--out", str(out), "--overwrite", "--json"], check=True,
                   capture_output=True, text=True)
    quantize_s = round(time.perf_counter() - t, 1)
    evaluation = json.loads((out / "fp4sense-quantize.json").read_text())
    verdicts, tail = verify_vllm([out])
    served = verdicts.get(out.name, {"error": tail})
    plan = json.loads((out / "plan.json").read_text())
    return {"quantize_s": quantize_s, "evaluation": evaluation.get("eval"),
            "experts_in": sorted({c["scheme"] for c in plan["choices"]
                                  if c["unit"].endswith("mlp.experts")}),
            "verify_vllm": {k: served.get(k) for k in (
                "passed", "mean_abs_diff", "max_abs_diff", "tokens", "error")}}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, default=None, help="where the models go")
    ap.add_argument("--windows", type=int, default=8, help="analysis windows")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:
        analysis_child(args.child[0], int(args.child[1]), args.child[2])
        return 0
    from fp4sense.api import BUNDLED_MODEL_NOTE
    from fp4sense.inputs.assets import ensure_model
    from fp4sense.inputs.texts import protocol_windows

    work = args.work or Path(tempfile.mkdtemp(prefix="fp4sense-moe-"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_model(log=lambda m: None))
    probe = protocol_windows(tok, "evaluation", 1)
    result = {"command": command("moe", args.argv), "protocol": {"analysis_windows": args.windows,
                           "eval_windows": args.eval_windows, "menu": MENU},
              "note": BUNDLED_MODEL_NOTE, "variants": {}}
    for name, k in VARIANTS.items():
        folder = build(work / f"smollm2-moe-top{k}", k)
        dense = check_dense(folder, probe[:1])
        out = work / f"analysis-top{k}"
        done = subprocess.run(child("moe", "--child", str(folder), str(args.windows),
                                    str(out)), capture_output=True, text=True, check=True,
                              cwd=REPO)
        cost = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, dense, cost, flush=True)
        result["variants"][name] = {"top_k": k, "vs_dense": dense, "analysis": cost,
                                    **evaluate_variant(folder, out / "sensitivity.json",
                                                       args.eval_windows)}
        if k < 8:
            result["variants"][name]["checkpoint"] = checkpoint_check(folder, work)
            print(json.dumps(result["variants"][name]["checkpoint"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, RESULTS / "moe.md")
    print((RESULTS / "moe.md").read_text())
    return 0


def write_markdown(result: dict, path: Path) -> None:
    from fp4sense.reports.moe import low_coverage

    lines = ["# FP4 plans on SmolLM2-MoE", "",
             f"Menu {', '.join(MENU)}; {result['protocol']['analysis_windows']} analysis "
             f"windows (estimated), KL on {result['protocol']['eval_windows']} evaluation "
             "windows. Bits count every expert (stored); active bits count the experts a "
             "token runs.", "", f"> {result['note']}", ""]
    for name, v in result["variants"].items():
        d = v["vs_dense"]
        uniform = v["rows"][0]
        lines += [f"## {name}", "",
                  f"Base PPL {v['base_ppl']:.2f} (dense SmolLM2 on one evaluation window "
                  f"{d['dense_ppl']:.2f}, this model {d['moe_ppl']:.2f}; largest logit "
                  f"difference {d['max_abs_logit_diff']:.2g}). Experts hold "
                  f"{v['expert_share']:.0%} of the quantizable weights. Estimated analysis "
                  f"{v['analysis']['wall_s']:.0f} s, peak RSS "
                  f"{v['analysis']['peak_rss_gib']:.2f} GiB.", "",
                  "| method | budget | bits | active bits | KL | vs uniform | PPL | top-1 | "
                  "experts in |", "|---|---|---|---|---|---|---|---|---|"]
        for r in v["rows"]:
            cut = 1 - r["kl"] / uniform["kl"]
            lines.append(
                f"| {r['method']} | {r['budget'] or '-'} | {r['bits']:.3f} | "
                f"{r['active_bits']:.3f} | {r['kl']:.4f} ± {r['kl_se']:.4f} | "
                f"{'-' if r is uniform else f'{cut:.0%} lower'} | {r['ppl']:.2f} | "
                f"{r['top1']:.3f} | {', '.join(r['expert_schemes'])} |")
        named = {u: [e for e, _ in few] for u, few in low_coverage(v["routing"]).items()}
        ck = v.get("checkpoint")
        if ck:
            e, served = ck["evaluation"] or {}, ck["verify_vllm"]
            lines += ["", f"Uniform NVFP4 written by `fp4sense quantize` ({ck['quantize_s']:.0f} "
                      f"s) and evaluated from disk: KL {e.get('kl', float('nan')):.4f}, "
                      f"{e.get('effective_bits', float('nan')):.3f} bits stored. "
                      f"`verify-vllm` (fp4sense's NVFP4 fused-MoE CPU experts): "
                      + ("PASS" if served.get("passed") else f"FAIL {served}")
                      + (f", mean |Δ log-prob| {served['mean_abs_diff']:.3f} against "
                         f"transformers over {served['tokens']} tokens"
                         if served.get("mean_abs_diff") is not None else "") + "."]
        lines += ["", f"Routing coverage (calibration text): {len(named)} of "
                  f"{len(v['routing'])} blocks have experts under 10% of an even share"
                  + (": " + "; ".join(f"{u} {e}" for u, e in list(named.items())[:6])
                     if named else "") + ".", ""]
    path.write_text("\n".join(lines) + "\n")

