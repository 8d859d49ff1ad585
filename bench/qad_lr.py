"""Benchmark: the learning rate of QAD after GPTQ, judged on calibration windows only.

QAD after GPTQ starts with every weight on GPTQ's grid, under GPTQ's fixed scales: a
code changes only when its weight moves half a grid step, and AdamW moves a weight by
about the learning rate per step. This runs `fp4sense quantize --gptq --distill STEPS`
on the bundled SmolLM2 (W4A4 menu at 5.0 bits by default, planned from the stack
benchmark's shared estimate) for each learning rate and each factor on the 4-bit units'
rate (``--lr-4bit``: their grid steps are several times FP8's), and reports QAD's own KL
before and after on its training windows and on held-out calibration windows, the share
of stored weight codes that differ from the untrained GPTQ checkpoint's, and the time; no
evaluation text is read.

    .venv/bin/python -m bench qad_lr --lrs 5e-5,5e-4 [--lr-4bit 1,4] [--holdout 4]
        [--menu NVFP4A16,FP8_DYNAMIC,BF16]

Results: bench/results/qad_lr.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import RESULTS, command


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lrs", default="5e-5,5e-4")
    parser.add_argument("--lr-4bit", default="1")
    parser.add_argument("--holdout", type=int, default=0)
    parser.add_argument("--menu", default="NVFP4,FP8_DYNAMIC,BF16")
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--qad-windows", type=int, default=8)
    parser.add_argument("--sensitivity", type=Path,
                        default=RESULTS / ".stack-cache" / "sensitivity.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "qad_lr.json")


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file

    from fp4sense.api import quantize_model
    from fp4sense.quantization.distill import DistillSettings

    menu = args.menu.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4sense-qad-lr-") as tmp:
        def one(name: str, lr: float | None, factor: float = 1.0) -> tuple[Path, float]:
            distill = (DistillSettings(steps=args.steps, lr=lr, lr_4bit=factor,
                                       windows=args.qad_windows, holdout=args.holdout)
                       if lr is not None else None)
            t = time.perf_counter()
            quantize_model(None, out_dir=Path(tmp) / name, budget_bits=args.budget, menu=menu,
                           sensitivity=args.sensitivity, gptq=True, distill=distill,
                           evaluate=False, progress=False, log=lambda m: None)
            return Path(tmp) / name, time.perf_counter() - t

        gptq, gptq_s = one("gptq", None)
        base = load_file(gptq / "model.safetensors")
        codes = [k for k in base if k.endswith(("weight_packed", "proj.weight"))]
        pairs = [(float(lr), float(f)) for lr in args.lrs.split(",")
                 for f in args.lr_4bit.split(",")]
        for lr, factor in pairs:
            folder, wall = one(f"lr{lr:g}x{factor:g}", lr, factor)
            record = json.loads((folder / "distill.json").read_text())
            got = load_file(folder / "model.safetensors")
            moved = {kind: _changed([k for k in codes if k.endswith(kind)], base, got)
                     for kind in ("weight_packed", "proj.weight")}
            row = {"lr": lr, "lr_4bit": factor, "loss_before": record["loss_before"],
                   "loss_after": record["loss_after"], "rollbacks": len(record["rollbacks"]),
                   "changed_fp4_bytes": moved["weight_packed"],
                   "changed_fp8_codes": moved["proj.weight"],
                   "holdout": record.get("holdout"), "qad_s": record["time_s"],
                   "wall_s": round(wall, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    params = {k: v for k, v in vars(args).items() if k != "argv"}
    args.out.write_text(json.dumps({"command": command("qad_lr", args.argv),
                                    "params": {**params, "out": None,
                                               "sensitivity": args.sensitivity.name},
                                    "gptq_wall_s": round(gptq_s, 1), "rows": rows}, indent=1))
    return 0


def _changed(keys, a, b) -> float | None:
    """Share of stored elements (packed FP4 bytes, FP8 codes) that differ."""
    if not keys:
        return None
    n = sum(a[k].numel() for k in keys)
    return sum(int((a[k].view(torch.uint8) != b[k].view(torch.uint8)).sum()) for k in keys) / n

