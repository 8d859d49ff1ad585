"""The main job on the bundled SmolLM2 and State of the Union text (`make demo`).

1. analyze: measured component and block views and the estimated grid, NVFP4 and MXFP4
   (a quick analysis: 2 calibration windows; the benchmark uses 8);
2. quantize at 4.75 bits per weight with the menu {NVFP4, FP8_DYNAMIC, BF16} and, as
   `fp4sense quantize` does by default, NVFP4's searched-scale twin (estimated
   sensitivities, llm-compressor oneshot, compressed-tensors checkpoint);
3. the same path with the menu {NVFP4} alone and no scale search: uniform NVFP4 as
   llm-compressor writes it, the starting point;
4. evaluate both per protocol (16 evaluation windows) and verify the planned checkpoint
   in vLLM (serve environment);
5. print a summary table and the paths.

Rerunning reuses the cached analysis; the checkpoints are rebuilt (``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--out", type=Path, default=Path("demo-output"))
    parser.add_argument("--analysis-windows", type=int, default=2)
    parser.add_argument("--calib-windows", type=int, default=16)
    parser.add_argument("--budget", type=float, default=4.75)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args(argv)

    from fp4sense.api import analyze_model, quantize_model
    from fp4sense.reports.analysis import findings

    t0 = time.perf_counter()
    times = {}
    print("== 1/4 analyze (NVFP4, MXFP4: measured component + block views, estimated grid)")
    t = time.perf_counter()
    report = analyze_model(args.model, schemes=["NVFP4", "MXFP4"],
                           views=["component", "block", "grid"],
                           modes=["measured", "estimated"], grid_blocks=[],
                           analysis_windows=args.analysis_windows, out_dir=args.out / "analysis")
    times["analyze"] = time.perf_counter() - t

    print(f"== 2/4 quantize at {args.budget} bits (menu NVFP4 + searched twin, FP8_DYNAMIC, "
          "BF16)")
    t = time.perf_counter()
    planned = quantize_model(args.model, out_dir=args.out / "checkpoint", budget_bits=args.budget,
                             calib_windows=args.calib_windows, overwrite=True)
    times["quantize"] = time.perf_counter() - t

    print("== 3/4 uniform NVFP4 (the same path, menu NVFP4 alone, amax scales)")
    t = time.perf_counter()
    uniform = quantize_model(args.model, out_dir=args.out / "uniform-nvfp4", budget_bits=16.0,
                             menu=["NVFP4"], calib_windows=args.calib_windows,
                             sensitivity=args.out / "checkpoint" / "sensitivity.json",
                             scale_search=False, overwrite=True)
    times["uniform"] = time.perf_counter() - t

    verified = None
    if not args.skip_vllm:
        print("== 4/4 verify the planned checkpoint in vLLM")
        from transformers import AutoTokenizer

        from fp4sense.evaluation.vllm_check import verify_vllm
        from fp4sense.inputs.texts import protocol_windows

        t = time.perf_counter()
        ck = args.out / "checkpoint"
        windows = protocol_windows(AutoTokenizer.from_pretrained(ck), "evaluation", 2)
        verified = verify_vllm(ck, windows)
        times["verify_vllm"] = time.perf_counter() - t

    a, b = planned["eval"], uniform["eval"]
    rows = [("uniform NVFP4", b), (f"fp4sense plan @ {args.budget}", a)]
    print("\n| checkpoint | effective bits | KL vs base | PPL | top-1 |")
    print("|---|---|---|---|---|")
    for name, e in rows:
        print(f"| {name} | {e['effective_bits']:.3f} | {e['kl']:.4f} ± {e['kl_se']:.4f} | "
              f"{e['ppl']:.2f} | {e['top1']:.3f} |")
    print(f"\nbase PPL {a['base_ppl']:.2f}; KL {1 - a['kl'] / b['kl']:.0%} lower than uniform "
          f"NVFP4 at {a['effective_bits'] - b['effective_bits']:+.2f} bits per weight")
    if verified is not None:
        print(f"vLLM: {'PASS' if verified.passed else 'FAIL'} (mean |Δ logprob| "
              f"{verified.mean_abs_diff:.3f}, PPL vLLM {verified.vllm_ppl:.2f} vs "
              f"transformers {verified.transformers_ppl:.2f})")
    print("\nfindings (quick analysis):")
    for line in findings(report)[:6]:
        print(f"- {line.replace('**', '')}")
    times["total"] = time.perf_counter() - t0
    summary = {"planned": a, "uniform": b, "seconds": {k: round(v) for k, v in times.items()},
               "vllm": verified.to_dict() if verified else None}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nreport      {args.out / 'analysis' / 'report.md'} (+ plots beside it)")
    print(f"checkpoint  {args.out / 'checkpoint'} (model card: README.md, plan.png)")
    print(f"summary     {args.out / 'summary.json'}; "
          f"{', '.join(f'{k} {v:.0f} s' for k, v in times.items())}")
    return 0 if verified is None or verified.passed else 4


if __name__ == "__main__":
    sys.exit(main())
