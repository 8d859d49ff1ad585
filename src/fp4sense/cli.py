"""The ``fp4sense`` command line (and the commands other front doors reuse).

Exit codes: see ``EXIT_CODES_HELP``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fp4sense import __version__
from fp4sense.validate import (
    block_list,
    non_empty,
    non_negative_float,
    positive_float,
    positive_int,
)

EXIT_OK = 0
EXIT_USER_ERROR = 1  # bad input, named in one line (2 is argparse's usage error)
EXIT_ASSET_ERROR = 3
EXIT_VERIFY_FAILED = 4
EXIT_HUB_ERROR = 5
EXIT_INTERRUPTED = 130
EXIT_CODES_HELP = """exit codes:
  0    success
  1    bad input (a file, model, scheme, budget or folder), named in one line
  2    usage error (unknown flag, missing argument, a value out of range)
  3    an offline asset (bundled model or text) could not be fetched or verified
  4    verify-vllm: vLLM and transformers disagree beyond the tolerance
  5    push: no token, the Hub not reachable, or the upload refused
  130  interrupted (Ctrl-C); no partial output folder is left
"""


# With --json, stdout carries the JSON document alone: while a command runs, file
# descriptor 1 points at stderr (hosts log to stdout: llm-compressor's loguru does), and
# the document is written to the saved stdout.
_json_out = None


def _emit_json(obj) -> None:
    stream = _json_out or sys.stdout
    stream.write(json.dumps(obj, indent=2) + "\n")
    stream.flush()


@contextlib.contextmanager
def _stdout_for_json(enabled: bool):
    global _json_out
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _json_out = os.fdopen(saved, "w")
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        _json_out.close()
        _json_out = None


def _cmd_setup(args: argparse.Namespace) -> int:
    from fp4sense.assets import ensure_assets

    paths = ensure_assets()
    if args.json:
        _emit_json({k: str(v) for k, v in paths.items()})
    else:
        for key, path in paths.items():
            print(f"{key:12s} {path}")
    return EXIT_OK


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from fp4sense.gguf import convert_gguf

    out = convert_gguf(args.gguf, args.out, overwrite=args.overwrite, name_or_path=args.name)
    _emit_json({"out": str(out)}) if args.json else print(f"wrote {out}")
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
        _emit_json(rows)
        return EXIT_OK
    print(f"{'scheme':17s} {'weights':8s} {'acts':7s} {'block':>5s} {'bits/w':>7s}  description")
    for r in rows:
        print(
            f"{r['name']:17s} {r['weights']:8s} {r['activations']:7s} {str(r['block'] or '-'):>5s} "
            f"{r['bits_per_weight_576x1536']:7.3f}  {r['description']}"
        )
    return EXIT_OK


def _cmd_verify_vllm(args: argparse.Namespace) -> int:
    from fp4sense.data import protocol_windows
    from fp4sense.verify import Tolerance, check_checkpoint, checkpoint_tokenizer, verify_vllm

    check_checkpoint(args.checkpoint)  # before the tokenizer: a missing folder is one line
    tokenizer = checkpoint_tokenizer(args.checkpoint)
    windows = protocol_windows(tokenizer, "evaluation", args.windows, source=_text(args))
    windows = windows[:, : args.tokens]
    limits = (args.max_abs, args.mean_abs, args.ppl_rel)
    tolerance = None if all(v is None for v in limits) else Tolerance(
        *(math.inf if v is None else v for v in limits))
    result = verify_vllm(
        args.checkpoint, windows, prompt=args.prompt, serve_python=args.serve_python,
        tolerance=tolerance, timeout_s=args.timeout,
    )
    if args.json:
        _emit_json(result.to_dict())
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
    report = analyze_model(
        args.model, text=_text(args), schemes=_csv(args.schemes), views=_csv(args.views),
        modes=modes, n_windows=args.windows, window_tokens=args.tokens,
        grid_blocks=args.grid_blocks,
        out_dir=args.out, cache=not args.no_cache, plots=not args.no_plots,
        offload_dir=args.offload_dir, progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    if args.json:
        _emit_json({"out": str(args.out), "base_ppl": report.base_ppl,
                    "cost": report.cost, "correlations": report.correlations,
                    "findings": findings(report)})
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
        try:
            re.compile(pattern.removeprefix("re:"))
        except re.error as exc:
            raise ValueError(f"--pin {item!r}: {pattern!r} is not a valid regular expression "
                             f"({exc}); escape dots and brackets, or name a unit such as "
                             "'3:mlp.down_proj'") from None
        pins[pattern] = scheme
    return pins


def _cmd_quantize(args: argparse.Namespace) -> int:
    from fp4sense.api import quantize_model

    result = quantize_model(
        args.model, out_dir=args.out, budget_bits=args.budget, budget_bytes=args.budget_bytes,
        kl_target=args.kl_target, menu=_csv(args.menu), sensitivity=args.sensitivity,
        sensitivity_mode=args.sensitivity_mode, pins=_pins(args.pin), gptq=args.gptq,
        text=_text(args), calib_windows=args.calib_windows, estimate_windows=args.windows,
        window_tokens=args.tokens, evaluate=not args.no_eval, eval_windows=args.eval_windows,
        overwrite=args.overwrite, base_model_id=args.base_model_id,
        progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    if args.json:
        _emit_json(result)
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

    r = evaluate_checkpoint(args.checkpoint, base=args.base, text=_text(args),
                            n_windows=args.windows, window_tokens=args.tokens,
                            as_served=args.as_served, progress=not args.json)
    if args.json:
        _emit_json(r)
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


def _cmd_push(args: argparse.Namespace) -> int:
    from fp4sense.hub import push

    result = push(args.checkpoint, args.repo_id, private=args.private, dry_run=args.dry_run,
                  revision=args.revision, commit_message=args.message,
                  allow_local_paths=args.allow_local_paths)
    if args.json:
        _emit_json(result)
        return EXIT_OK
    print(f"checkpoint        {result['folder']} ({result['quantization_format']})")
    print(f"repo              {result['repo_id']}{' (private if created)' if args.private else ''}")
    meta = {k: v for k, v in result["card"].items() if k in ("base_model", "license")}
    print("model card        valid" + (f" ({', '.join(f'{k}: {v}' for k, v in meta.items())})"
                                        if meta else ""))
    for f in result["files"]:
        note = "  (vllm serve names the repo)" if f["path"] == "README.md" and \
            result["card_rewritten"] else ""
        print(f"  {f['size']:>14,}  {f['path']}{note}")
    print(f"{len(result['files'])} files, {result['bytes']:,} bytes")
    for note in result["notes"]:
        print(f"note              {note}")
    if args.dry_run:
        print("dry run: every check passed; nothing was uploaded")
    else:
        print(f"uploaded          {result['url']}"
              + (" (repo created)" if result["created"] else ""))
    return EXIT_OK


# --- the parser: one function per command adds its arguments, so that other front doors
# (optimum-cli) take the same flags --------------------------------------------------------
def _add_model_and_text(p: argparse.ArgumentParser, text_help: str) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="hub id or local folder (default: the bundled SmolLM2-135M)")
    _add_text(p, text_help)


def _add_text(p: argparse.ArgumentParser, text_help: str) -> None:
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", type=non_empty, default=None, help=text_help)
    text.add_argument("--dataset", type=non_empty, default=None,
                      help="HF dataset NAME[:CONFIG[:SPLIT]]")


def _text(args: argparse.Namespace) -> str | None:
    return f"dataset:{args.dataset}" if args.dataset else args.text


def _add_windows(p: argparse.ArgumentParser, default: int, what: str) -> None:
    p.add_argument("--windows", type=positive_int, default=default,
                   help=f"{what} (default {default})")
    p.add_argument("--tokens", type=positive_int, default=512,
                   help="tokens per window (default 512)")


def _add_json(p: argparse.ArgumentParser, what: str = "print the result as JSON") -> None:
    p.add_argument("--json", action="store_true", help=what)


def _setup_args(p: argparse.ArgumentParser) -> None:
    _add_json(p, "print the asset paths as JSON")


def _convert_gguf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", type=Path, help="path of the .gguf file")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--name", default=None, help="name_or_path to record (e.g. the hub id)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    _add_json(p)


def _analyze_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "analysis text file (default: protocol calibration split)")
    p.add_argument("--schemes", type=non_empty, default="NVFP4,MXFP4",
                   help="comma-separated schemes of the menu (see `fp4sense schemes`)")
    p.add_argument("--views", type=non_empty, default="component,block",
                   help="comma-separated views: component, block, grid")
    p.add_argument("--mode", choices=["measured", "estimated", "both"], default="measured",
                   help="measured (isolation runs), estimated (one Fisher pass), or both")
    p.add_argument("--grid-blocks", type=block_list, default=None,
                   help="measure the grid only for these blocks (comma-separated; '' for "
                   "none, the estimate alone; default: all)")
    _add_windows(p, 8, "analysis windows")
    p.add_argument("--out", type=Path, default=Path("fp4sense-analysis"),
                   help="output folder (sensitivity.json, report.md, plots)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--offload-dir", type=Path, default=None,
                   help="keep decoder blocks on disk here, one in memory at a time")
    _add_json(p, "print a JSON summary")


def _quantize_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "calibration text file (default: protocol calibration split)")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--budget", type=positive_float,
                      help="average bits per weight, e.g. 4.75")
    goal.add_argument("--budget-bytes", type=positive_int, help="bytes of the decoder linears")
    goal.add_argument("--kl-target", type=positive_float,
                      help="fewest bits with predicted KL below")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--menu", type=non_empty, default="NVFP4,FP8_DYNAMIC,BF16",
                   help="schemes units may get")
    p.add_argument("--sensitivity", type=Path, default=None,
                   help="a saved sensitivity.json (default: estimate it now)")
    p.add_argument("--sensitivity-mode", choices=["measured", "estimated"], default=None,
                   help="which grid of the report to plan with")
    p.add_argument("--pin", action="append", metavar="UNIT_OR_REGEX=SCHEME",
                   help="force units to a scheme (repeatable)")
    p.add_argument("--gptq", action="store_true", help="round weights with GPTQ after planning")
    p.add_argument("--base-model-id", default=None, metavar="ORG/NAME",
                   help="the base model's Hub id, for the model card's lineage (default: "
                        "derived where certain: a hub id, a Hugging Face cache folder)")
    p.add_argument("--calib-windows", type=positive_int, default=32,
                   help="calibration windows")
    _add_windows(p, 8, "windows for the sensitivity estimate (the first calibration ones)")
    p.add_argument("--eval-windows", type=positive_int, default=16,
                   help="evaluation windows for the model card's figures")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation for the card")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    _add_json(p)


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--base", default=None, help="unquantized model (default: as recorded)")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    _add_windows(p, 16, "evaluation windows")
    p.add_argument("--as-served", action="store_true",
                   help="compute MXFP4A16 layers as W4A4, as vLLM serves them")
    _add_json(p)


def _verify_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    _add_windows(p, 2, "evaluation windows to score; tokens <= 512")
    p.add_argument("--prompt", default="The President of the United States said that")
    p.add_argument("--serve-python", default=None, help="python of the vLLM environment")
    p.add_argument("--max-abs", type=non_negative_float, default=None,
                   help="limit on max |d logprob| (default: by scheme, see README)")
    p.add_argument("--mean-abs", type=non_negative_float, default=None,
                   help="limit on mean |d logprob|")
    p.add_argument("--ppl-rel", type=non_negative_float, default=None,
                   help="limit on the relative perplexity difference")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds for the vLLM run")
    _add_json(p)


def _push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--repo-id", required=True, help="Hub repo, OWNER/NAME (or NAME: yours)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check and list the files; upload nothing")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    p.add_argument("--message", default=None, help="commit message")
    p.add_argument("--allow-local-paths", action="store_true",
                   help="upload JSON files that record paths of this machine (older checkpoints)")
    _add_json(p)


def _schemes_args(p: argparse.ArgumentParser) -> None:
    _add_json(p, "print as JSON")


# name -> (help, arguments, action); the order is the order of `fp4sense --help`
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {
    "setup": ("fetch and verify the bundled model and text (offline cache)",
              _setup_args, _cmd_setup),
    "convert-gguf": ("convert a GGUF model file to an HF safetensors folder",
                     _convert_gguf_args, _cmd_convert_gguf),
    "analyze": ("layer-wise and block-wise FP4 sensitivity of MODEL (measured and/or "
                "estimated), written as a report", _analyze_args, _cmd_analyze),
    "quantize": ("plan under a budget from FP4 sensitivities and write a compressed-tensors "
                 "checkpoint with llm-compressor", _quantize_args, _cmd_quantize),
    "eval": ("PPL, KL vs base, top-1 agreement and effective bits of a compressed-tensors "
             "checkpoint", _eval_args, _cmd_eval),
    "verify-vllm": ("check that vLLM loads CHECKPOINT and computes the same log-probs as "
                    "transformers (runs the serve environment)", _verify_vllm_args,
                    _cmd_verify_vllm),
    "push": ("check a checkpoint folder and upload it to the Hugging Face Hub",
             _push_args, _cmd_push),
    "schemes": ("list the scheme menu with bits per weight", _schemes_args, _cmd_schemes),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4sense",
        description="FP4 (NVFP4 / MXFP4) sensitivity diagnosis and mixed-precision "
        "planning for llm-compressor, compressed-tensors and vLLM.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fp4sense {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, add_arguments, action) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add_arguments(p)
        p.set_defaults(func=action)
    return parser


def run_command(action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command; map the errors users can fix to one line and an exit code."""
    from fp4sense.assets import AssetError
    from fp4sense.gguf import GGUFConversionError
    from fp4sense.hub import HubError
    from fp4sense.verify import VerifyError

    codes = ((AssetError, EXIT_ASSET_ERROR), (HubError, EXIT_HUB_ERROR),
             (GGUFConversionError, EXIT_USER_ERROR), (VerifyError, EXIT_USER_ERROR),
             (ValueError, EXIT_USER_ERROR))
    try:
        with _stdout_for_json(bool(getattr(args, "json", False))):
            return int(action(args))
    except KeyboardInterrupt:
        print("fp4sense: interrupted; finished analysis entries stay cached, no partial "
              "output folder is left", file=sys.stderr)
        return EXIT_INTERRUPTED
    except tuple(t for t, _ in codes) as exc:
        print(f"fp4sense: error: {exc}", file=sys.stderr)
        return next(code for t, code in codes if isinstance(exc, t))
    except OSError as exc:  # a disk that fills or turns read-only mid-run: one line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fp4sense: error: could not read or write {where}{exc.strerror or exc}; "
              "free space or fix permissions and run again", file=sys.stderr)
        return EXIT_USER_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    return run_command(args.func, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
