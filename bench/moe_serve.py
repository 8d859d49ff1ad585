"""Benchmark addendum: SmolLM2-MoE (``bench/smollm2_moe.py``) in uniform NVFP4A16 and
NVFP4, written by `fp4sense quantize` and served by vLLM on the CPU through fp4sense's
fused-MoE experts (`fp4sense verify-vllm`: log-probs against transformers).

``--plans 5.0 5.5`` serves fp4sense plans (menu NVFP4 / FP8_DYNAMIC / BF16, searched
scales by default) instead, added to the same results file; plans whose experts get
FP8_DYNAMIC run on the plugin's FP8 experts.

The variant with every expert active (``--top-k 8``, the default here) has no routing
decision to get wrong; in the top-6 variant the router's logits are 1e-3 apart by
construction, so two engines' rounding can pick different experts for a token, and a
log-prob comparison there measures that as much as the kernels.

    .venv/bin/python -m bench moe_serve [--work DIR]

Results: bench/results/moe_serve_top{K}.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.harness import RESULTS, command
from bench.moe import checkpoint_check
from bench.smollm2_moe import build


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--plans", nargs="*", default=[], help="budgets of plans to serve")


def run(args: argparse.Namespace) -> int:
    work = args.work or Path(tempfile.mkdtemp(prefix="fp4sense-moe-"))
    folder = work / f"smollm2-moe-top{args.top_k}"
    if not (folder / "model.safetensors").is_file():
        build(folder, args.top_k)
    path = RESULTS / f"moe_serve_top{args.top_k}.json"
    result = json.loads(path.read_text()) if args.plans and path.is_file() else {}
    result["command"] = command("moe_serve", args.argv)
    result["model"] = f"SmolLM2-MoE, top-{args.top_k} of 8 experts"
    rows = ([(f"plan {b}", "NVFP4,FP8_DYNAMIC,BF16", b) for b in args.plans] if args.plans
            else [(s, s, "4.6") for s in ("NVFP4A16", "NVFP4")])
    for name, menu, budget in rows:
        result[name] = checkpoint_check(folder, work, menu, budget)
        print(json.dumps({name: result[name]["verify_vllm"]}), flush=True)
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0

