"""fp4sense from Python: diagnose, plan, quantize, evaluate, ready for the Hub.

    python examples/python_api.py                      # the bundled SmolLM2 (~10 min, 2 cores)
    python examples/python_api.py MODEL --out DIR      # any hub id or local folder

Every step is the function behind the CLI command of the same name, and every step
starts from the previous step's saved file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4sense.api import analyze_model, evaluate_checkpoint, quantize_model
from fp4sense.publishing.hub import check_folder
from fp4sense.reports.analysis import findings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: bundled SmolLM2")
    parser.add_argument("--text", default=None, help="default: the protocol's text")
    parser.add_argument("--out", type=Path, default=Path("fp4sense-example"))
    parser.add_argument("--windows", type=int, default=4, help="analysis windows")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budget", type=float, default=4.75, help="bits per weight")
    args = parser.parse_args()

    # 1. diagnose: the estimated unit x scheme grid (one Fisher pass) for both FP4 formats
    #    and FP8, the menu's fallback
    report = analyze_model(args.model, text=args.text, schemes=["NVFP4", "MXFP4", "FP8_DYNAMIC"],
                           views=["grid"], modes=["estimated"], analysis_windows=args.windows,
                           window_tokens=args.tokens, out_dir=args.out / "analysis")
    for line in findings(report)[:3]:
        print("-", line.replace("**", ""))

    # 2.+3. plan under the budget from the saved report and quantize with llm-compressor
    result = quantize_model(args.model, text=args.text, out_dir=args.out / "checkpoint",
                            budget_bits=args.budget, menu=["NVFP4", "FP8_DYNAMIC", "BF16"],
                            sensitivity=args.out / "analysis" / "sensitivity.json",
                            sensitivity_mode="estimated", calib_windows=args.windows,
                            window_tokens=args.tokens, evaluate=False, overwrite=True)
    print("plan:", result["plan"]["schemes"], f"{result['plan']['bits_theory']:.3f} bits")

    # 4. evaluate the checkpoint as written (effective bits read from the file)
    e = evaluate_checkpoint(result["out"], base=args.model, text=args.text,
                            eval_windows=args.windows, window_tokens=args.tokens)
    print(f"KL {e['kl']:.4f} ± {e['kl_se']:.4f}, PPL {e['ppl']:.2f} (base "
          f"{e['base_ppl']:.2f}), {e['effective_bits']:.3f} bits per weight")

    # 5. ready for the Hub: every check `fp4sense push` runs, and the files it would send
    ready = check_folder(result["out"])
    print(f"Hub-ready: {len(ready.files)} files, {ready.bytes:,} bytes "
          f"({ready.quantization_format})")


if __name__ == "__main__":
    main()
