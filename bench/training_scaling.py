"""How the training estimate grows with the model: random-weight Llama-family models of
growing size (bf16 files, built from configs, as ``scaling``), estimated with
``low_memory`` (one decoder block's weights at a time, read from the model's files; the
stakes' step written block by block to disk); peak RSS and wall time per billion
weights. Baseline in the same run: the largest model loaded whole, the same figures.

    .venv/bin/python -m bench training_scaling [--sizes 0.1,0.4] [--windows 2] [--tokens 128]

One estimate = what analyze-training computes for its recipe: the gradient stakes (one
AdamW step exact, one per gradient GEMM in NVFP4), the forward stakes (one forward per
unit kind) and one estimate pass (seeds 1). Each runs in a fresh process (its own peak
RSS). Float32 compute, CPU, no cache. Results: bench/results/training_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, RESULTS, child, command, peak_rss_gib
from bench.scaling import build


def estimate_child(folder: str, low_memory: bool, windows: int, tokens: int) -> dict:
    import torch

    from fp4sense.inputs.models import load_model
    from fp4sense.structure.units import find_units
    from fp4sense.training.estimate import (
        estimate_training,
        forward_stakes,
        gradient_stakes,
        training_units,
    )

    t = time.perf_counter()
    model, _, _ = load_model(folder, low_memory=low_memory)
    ids = torch.randint(0, 49152, (windows, tokens), generator=torch.Generator().manual_seed(0))
    units = find_units(model, ids[:1, :16])
    trained = training_units(units, model)
    stakes = gradient_stakes(model, ids, trained, "nvfp4", lr=1e-4, steps=4)
    forward = forward_stakes(model, ids, trained, "nvfp4")
    est = estimate_training(model, ids, units, "nvfp4", 1, stakes=stakes, forward=forward)
    damage = sum(g.damage for e in est for g in e.gemms.values())
    return {"wall_s": round(time.perf_counter() - t, 1), "peak_rss_gib": round(peak_rss_gib(), 3),
            "stakes": stakes, "forward": forward, "damage": damage}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default="0.1,0.4")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "fp4sense-scaling")
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "LOW_MEMORY"))


def run(args: argparse.Namespace) -> int:
    if args.child:
        folder, low = args.child
        print(json.dumps(estimate_child(folder, low == "1", args.windows, args.tokens)))
        return 0
    from fp4sense.inputs.assets import ensure_model

    tokenizer_from = ensure_model(log=lambda m: None)
    sizes = args.sizes.split(",")
    rows = []

    def measure(size, low):
        folder = args.models / f"llama-{size}b"
        numel = build(size, folder, tokenizer_from)
        out = subprocess.run(child("training_scaling", "--windows", str(args.windows),
                                   "--tokens", str(args.tokens), "--child", str(folder),
                                   "1" if low else "0"),
                             capture_output=True, text=True, check=True, cwd=REPO)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        row = {"size": size, "params_b": round(numel / 1e9, 3), "low_memory": low, **r,
               "s_per_b": round(r["wall_s"] / (numel / 1e9), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    lean = [measure(size, True) for size in sizes]
    whole = measure(sizes[-1], False)
    summary = {"command": command("training_scaling", args.argv), "windows": args.windows,
               "tokens": args.tokens, "rows": rows,
               "peak RSS largest / smallest (low memory)": round(
                   lean[-1]["peak_rss_gib"] / lean[0]["peak_rss_gib"], 2),
               "weights largest / smallest": round(lean[-1]["params_b"] / lean[0]["params_b"],
                                                   2),
               "seconds per billion weights, largest / smallest": round(
                   lean[-1]["s_per_b"] / lean[0]["s_per_b"], 2),
               "largest: peak RSS whole / low memory": round(
                   whole["peak_rss_gib"] / lean[-1]["peak_rss_gib"], 2),
               "largest: wall time low memory / whole": round(
                   lean[-1]["wall_s"] / whole["wall_s"], 2),
               "largest: damage low memory / whole": lean[-1]["damage"] / whole["damage"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "training_scaling.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    return 0
