"""Benchmark: QAD with FP4 backward GEMMs against today's QAD (forward quantized only).

On the bundled SmolLM2 per protocol.md (float32 on CPU; KL / PPL / top-1 of the written
checkpoint on the first 16 evaluation windows), uniform W4A4 NVFP4 written by `fp4sense
quantize` three ways from one calibration text: without training (RTN), with QAD whose
backward is BF16 (``--distill-backward bf16``, today's), and with QAD whose dgrad and wgrad
run as each named training recipe quantizes them (``nvfp4``: Transformer Engine's, with
stochastic rounding and the wgrad Hadamard transform). Same steps, learning rate, windows
and seed; reported: KL ± SE, QAD's held-out KL before and after, QAD's time.

    .venv/bin/python -m bench qad_backward [--steps 32] [--backwards bf16,nvfp4]
        [--qad-windows 12] [--holdout 4] [--lr 5e-5]

Results: bench/results/qad_backward.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, command


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=32, help="QAD steps")
    parser.add_argument("--backwards", default="bf16,nvfp4")
    parser.add_argument("--qad-windows", type=int, default=12)
    parser.add_argument("--holdout", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--analysis-windows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "qad_backward.json")


def _row(folder: Path, label: str, distill, args) -> dict:
    from fp4sense.api import quantize_model

    t = time.perf_counter()
    result = quantize_model(None, out_dir=folder, budget_bits=16.0, menu=["NVFP4"],
                            scale_search=False, distill=distill,
                            calib_windows=args.qad_windows + args.holdout,
                            analysis_windows=args.analysis_windows, eval_windows=16,
                            overwrite=True, progress=False, log=lambda m: None)
    wall = time.perf_counter() - t
    e = result["eval"]
    row = {"row": label, "bits": e["effective_bits"], "kl": e["kl"], "kl_se": e["kl_se"],
           "ppl": e["ppl"], "top1": e["top1"],
           "wall_s": round(wall - result["timings"].get("eval_s", 0.0), 1)}
    if distill is not None:
        record = json.loads((folder / "distill.json").read_text())
        row["qad"] = {"backward": record["settings"]["backward"], "time_s": record["time_s"],
                      "loss_before": record["loss_before"], "loss_after": record["loss_after"],
                      "holdout": record.get("holdout"), "rollbacks": len(record["rollbacks"])}
    print(json.dumps(row), flush=True)
    return row


def run(args: argparse.Namespace) -> int:
    from fp4sense.quantization.distill import DistillSettings

    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4sense-qad-backward-") as tmp:
        rows.append(_row(Path(tmp) / "rtn", "uniform NVFP4 (RTN)", None, args))
        for backward in args.backwards.split(","):
            settings = DistillSettings(steps=args.steps, lr=args.lr, windows=args.qad_windows,
                                       holdout=args.holdout, backward=backward)
            rows.append(_row(Path(tmp) / backward, f"+ QAD, {backward} backward", settings,
                             args))
    params = {k: v for k, v in vars(args).items() if k not in ("argv", "out")}
    out = {"command": command("qad_backward", args.argv), "params": params, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(out))
    return 0


def _markdown(out: dict) -> str:
    lines = ["# QAD with FP4 backward GEMMs on SmolLM2", "", f"`{out['command']}`", "",
             "Uniform W4A4 NVFP4, float32 on CPU; KL of the written checkpoint on 16 "
             "evaluation windows. QAD trains before calibration on the calibration windows "
             "and ends on the state its held-out windows judge best.", "",
             "| row | KL (± se) | PPL | top-1 | QAD held-out KL before → after (step) | "
             "QAD s |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        q = r.get("qad")
        held = (f"{q['holdout']['before']:.4f} → {q['holdout']['after']:.4f} "
                f"({q['holdout']['step']})" if q and q.get("holdout") else "-")
        lines.append(f"| {r['row']} | {r['kl']:.4f} ± {r['kl_se']:.4f} | {r['ppl']:.2f} | "
                     f"{r['top1']:.3f} | {held} | {q['time_s'] if q else '-'} |")
    return "\n".join(lines) + "\n"
