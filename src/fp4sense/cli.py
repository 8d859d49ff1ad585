"""The ``fp4sense`` command line.

Exit codes: 0 success; 1 a user error (bad input, named in one line); 2 usage error
(argparse); 3 an offline asset could not be fetched; 4 verify-vllm found vLLM and
transformers disagreeing beyond the tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from fp4sense import __version__

EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_ASSET_ERROR = 3
EXIT_VERIFY_FAILED = 4


def _cmd_setup(args: argparse.Namespace) -> int:
    from fp4sense.assets import ensure_assets

    paths = ensure_assets()
    if args.json:
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    else:
        for key, path in paths.items():
            print(f"{key:12s} {path}")
    return EXIT_OK


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from fp4sense.gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out, overwrite=args.overwrite, name_or_path=args.name)
    print(f"wrote {out}")
    return EXIT_OK


def _cmd_schemes(args: argparse.Namespace) -> int:
    from fp4sense.schemes import MENU, bits_per_weight

    rows = [
        {
            "name": s.name,
            "weights": s.weight_format or "bf16",
            "activations": s.activations or "16-bit",
            "block": s.block_size,
            "bits_per_weight_576x1536": round(bits_per_weight(s, (576, 1536)), 5),
            "description": s.description,
        }
        for s in MENU.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(f"{'scheme':17s} {'weights':8s} {'acts':7s} {'block':>5s} {'bits/w':>7s}  description")
    for r in rows:
        print(
            f"{r['name']:17s} {r['weights']:8s} {r['activations']:7s} {str(r['block'] or '-'):>5s} "
            f"{r['bits_per_weight_576x1536']:7.3f}  {r['description']}"
        )
    return EXIT_OK


def _cmd_verify_vllm(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from fp4sense.data import protocol_windows
    from fp4sense.verify import Tolerance, verify_vllm

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    windows = protocol_windows(tokenizer, "evaluation", args.windows, source=args.text)
    windows = windows[:, : args.tokens]
    limits = (args.max_abs, args.mean_abs, args.ppl_rel)
    tolerance = None if all(v is None for v in limits) else Tolerance(
        *(math.inf if v is None else v for v in limits))
    result = verify_vllm(
        args.checkpoint, windows, prompt=args.prompt, serve_python=args.serve_python,
        tolerance=tolerance, timeout_s=args.timeout,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(f"checkpoint        {result.checkpoint}")
        print(f"tokens compared   {result.tokens}")
        tol = result.tolerance
        print(f"|d logprob| max   {result.max_abs_diff:.4f}   (limit {tol['max_abs']})")
        print(f"|d logprob| mean  {result.mean_abs_diff:.4f}   (limit {tol['mean_abs']})")
        print(f"perplexity        vLLM {result.vllm_ppl:.3f}   transformers "
              f"{result.transformers_ppl:.3f}")
        print(f"greedy completion {args.prompt!r} ->{result.completion!r}")
        for note in result.notes:
            print(f"note              {note}")
        print("PASS" if result.passed else "FAIL: vLLM and transformers differ beyond tolerance")
    return EXIT_OK if result.passed else EXIT_VERIFY_FAILED


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _cmd_analyze(args: argparse.Namespace) -> int:
    from fp4sense.api import analyze_model
    from fp4sense.report import findings

    modes = ["measured", "estimated"] if args.mode == "both" else [args.mode]
    text = f"dataset:{args.dataset}" if args.dataset else args.text
    report = analyze_model(
        args.model, text=text, schemes=_csv(args.schemes), views=_csv(args.views),
        modes=modes, n_windows=args.windows, window_tokens=args.tokens,
        grid_blocks=[int(b) for b in _csv(args.grid_blocks)] if args.grid_blocks else None,
        out_dir=args.out, cache=not args.no_cache, plots=not args.no_plots,
        offload_dir=args.offload_dir, progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    if args.json:
        print(json.dumps({"out": str(args.out), "base_ppl": report.base_ppl,
                          "cost": report.cost, "correlations": report.correlations,
                          "findings": findings(report)}, indent=2))
    else:
        print()
        for line in findings(report):
            print(f"- {line.replace('**', '')}")
    return EXIT_OK


def _pins(values: list[str] | None) -> dict[str, str]:
    pins = {}
    for item in values or []:
        pattern, sep, scheme = item.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"--pin {item!r}: write UNIT_OR_REGEX=SCHEME, e.g. "
                             "'.*layers\\.0\\..*=BF16'")
        pins[pattern] = scheme
    return pins


def _cmd_quantize(args: argparse.Namespace) -> int:
    from fp4sense.api import quantize_model

    text = f"dataset:{args.dataset}" if args.dataset else args.text
    result = quantize_model(
        args.model, out_dir=args.out, budget_bits=args.budget, budget_bytes=args.budget_bytes,
        kl_target=args.kl_target, menu=_csv(args.menu), sensitivity=args.sensitivity,
        sensitivity_mode=args.sensitivity_mode, pins=_pins(args.pin), gptq=args.gptq,
        text=text, calib_windows=args.calib_windows, estimate_windows=args.windows,
        window_tokens=args.tokens, evaluate=not args.no_eval, eval_windows=args.eval_windows,
        overwrite=args.overwrite,
        progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"checkpoint        {result['out']}")
        e = result.get("eval")
        if e:
            print(f"effective bits    {e['effective_bits']:.3f}")
            print(f"KL vs base        {e['kl']:.4f} ± {e['kl_se']:.4f}")
            print(f"perplexity        {e['ppl']:.3f} (base {e['base_ppl']:.3f})")
            print(f"top-1 agreement   {e['top1']:.3f}")
    return EXIT_OK


def _cmd_eval(args: argparse.Namespace) -> int:
    from fp4sense.api import evaluate_checkpoint

    r = evaluate_checkpoint(args.checkpoint, base=args.base, text=args.text,
                            n_windows=args.windows, window_tokens=args.tokens,
                            as_served=args.as_served, progress=not args.json)
    if args.json:
        print(json.dumps(r, indent=2))
        return EXIT_OK
    print(f"checkpoint        {r['checkpoint']} ({r['format']})")
    print(f"base              {r['base']}")
    print(f"effective bits    {r['effective_bits']:.3f}")
    print(f"KL vs base        {r['kl']:.4f} ± {r['kl_se']:.4f}")
    print(f"perplexity        {r['ppl']:.3f} (base {r['base_ppl']:.3f})")
    print(f"top-1 agreement   {r['top1']:.3f}")
    print(f"tokens            {r['tokens']}")
    for note in r["notes"]:
        print(f"note              {note}")
    return EXIT_OK


def _add_model_and_text(p: argparse.ArgumentParser, text_help: str) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="hub id or local folder (default: the bundled SmolLM2-135M)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", default=None, help=text_help)
    text.add_argument("--dataset", default=None, help="HF dataset NAME[:CONFIG[:SPLIT]]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4sense",
        description="FP4 (NVFP4 / MXFP4) sensitivity diagnosis and mixed-precision "
        "planning for llm-compressor, compressed-tensors and vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"fp4sense {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("setup", help="fetch and verify the bundled model and text (offline cache)")
    p.add_argument("--json", action="store_true", help="print the asset paths as JSON")
    p.set_defaults(func=_cmd_setup)

    p = sub.add_parser("convert-gguf", help="convert a GGUF model file to an HF safetensors folder")
    p.add_argument("gguf", type=Path, help="path of the .gguf file")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--name", default=None, help="name_or_path to record (e.g. the hub id)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_cmd_convert_gguf)

    p = sub.add_parser("analyze", help="layer-wise and block-wise FP4 sensitivity of MODEL "
                       "(measured and/or estimated), written as a report")
    _add_model_and_text(p, "analysis text file (default: protocol calibration split)")
    p.add_argument("--schemes", default="NVFP4,MXFP4",
                   help="comma-separated schemes of the menu (see `fp4sense schemes`)")
    p.add_argument("--views", default="component,block",
                   help="comma-separated views: component, block, grid")
    p.add_argument("--mode", choices=["measured", "estimated", "both"], default="measured",
                   help="measured (isolation runs), estimated (one Fisher pass), or both")
    p.add_argument("--grid-blocks", default=None,
                   help="measure the grid only for these blocks (comma-separated)")
    p.add_argument("--windows", type=int, default=8, help="analysis windows (default 8)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per window")
    p.add_argument("--out", type=Path, default=Path("fp4sense-analysis"),
                   help="output folder (sensitivity.json, report.md, plots)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--offload-dir", type=Path, default=None,
                   help="keep decoder blocks on disk here, one in memory at a time")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("quantize", help="plan under a budget from FP4 sensitivities and write a "
                       "compressed-tensors checkpoint with llm-compressor")
    _add_model_and_text(p, "calibration text file (default: protocol calibration split)")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--budget", type=float, help="average bits per weight, e.g. 4.75")
    goal.add_argument("--budget-bytes", type=int, help="bytes of the decoder linears")
    goal.add_argument("--kl-target", type=float, help="fewest bits with predicted KL below")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--menu", default="NVFP4,FP8_DYNAMIC,BF16", help="schemes units may get")
    p.add_argument("--sensitivity", type=Path, default=None,
                   help="a saved sensitivity.json (default: estimate it now)")
    p.add_argument("--sensitivity-mode", choices=["measured", "estimated"], default=None,
                   help="which grid of the report to plan with")
    p.add_argument("--pin", action="append", metavar="UNIT_OR_REGEX=SCHEME",
                   help="force units to a scheme (repeatable)")
    p.add_argument("--gptq", action="store_true", help="round weights with GPTQ after planning")
    p.add_argument("--calib-windows", type=int, default=32, help="calibration windows")
    p.add_argument("--windows", type=int, default=8,
                   help="windows for the sensitivity estimate (the first calibration ones)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per window")
    p.add_argument("--eval-windows", type=int, default=16,
                   help="evaluation windows for the model card's figures")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation for the card")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("eval", help="PPL, KL vs base, top-1 agreement and effective bits of a "
                       "compressed-tensors checkpoint")
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--base", default=None, help="unquantized model (default: as recorded)")
    p.add_argument("--text", default=None, help="evaluation text (default: protocol split)")
    p.add_argument("--windows", type=int, default=16, help="evaluation windows")
    p.add_argument("--tokens", type=int, default=512, help="tokens per window")
    p.add_argument("--as-served", action="store_true",
                   help="compute MXFP4A16 layers as W4A4, as vLLM serves them")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("verify-vllm", help="check that vLLM loads CHECKPOINT and computes the "
                       "same log-probs as transformers (runs the serve environment)")
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--windows", type=int, default=2, help="evaluation windows to score")
    p.add_argument("--tokens", type=int, default=512, help="tokens per window (<= 512)")
    p.add_argument("--text", default=None, help="evaluation text file (default: protocol)")
    p.add_argument("--prompt", default="The President of the United States said that")
    p.add_argument("--serve-python", default=None, help="python of the vLLM environment")
    p.add_argument("--max-abs", type=float, default=None,
                   help="limit on max |d logprob| (default: by scheme, see README)")
    p.add_argument("--mean-abs", type=float, default=None, help="limit on mean |d logprob|")
    p.add_argument("--ppl-rel", type=float, default=None,
                   help="limit on the relative perplexity difference")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the vLLM run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_verify_vllm)

    p = sub.add_parser("schemes", help="list the scheme menu with bits per weight")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_schemes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    from fp4sense.assets import AssetError
    from fp4sense.gguf import GGUFConversionError
    from fp4sense.verify import VerifyError

    try:
        return int(args.func(args))
    except AssetError as exc:
        print(f"fp4sense: error: {exc}", file=sys.stderr)
        return EXIT_ASSET_ERROR
    except (GGUFConversionError, VerifyError, ValueError) as exc:
        print(f"fp4sense: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
