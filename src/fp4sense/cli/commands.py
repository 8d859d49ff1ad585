"""The ``fp4sense`` command line (and the commands other front doors reuse); exit codes:
see ``EXIT_CODES_HELP``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from fp4sense import __version__, options
from fp4sense.cli.arguments import (
    analyze_args,
    convert_gguf_args,
    eval_args,
    push_args,
    quantize_args,
    schemes_args,
    setup_args,
    text_source,
    verify_vllm_args,
)
from fp4sense.cli.streams import (
    Terminated,
    interrupt_line,
    settle_interrupt,
    sigterm_as_interrupt,
)
from fp4sense.cli.streams import emit_json as _emit_json
from fp4sense.cli.streams import stdout_for_json as _stdout_for_json
from fp4sense.cli.training import (
    analyze_training_args,
    run_analyze_training,
    run_train_trial,
    train_trial_args,
)
from fp4sense.inputs.assets import default_model_path
from fp4sense.runtime.outputs import check_analysis_output, guard_output, local_inputs
from fp4sense.validate import EXIT_USER_ERROR, UserError, read_json

EXIT_OK = 0  # 1, 3, 5: the errors users can fix (fp4sense.validate.UserError.exit_code)
EXIT_VERIFY_FAILED = 4
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_CODES_HELP = """exit codes:
  0    success
  1    bad input (a file, model, scheme, budget, folder or device) or a stopped rank, in one line
  2    usage error (unknown flag, missing argument, a value out of range)
  3    an offline asset (bundled model or text) could not be fetched or verified
  4    verify-vllm: vLLM and transformers disagree beyond the tolerance
  5    push: no token, the Hub not reachable, or the upload refused
  130  interrupted (Ctrl-C); no partial output folder is left
  143  terminated (SIGTERM: a scheduler, docker stop, timeout); as 130
"""


def _cmd_setup(args: argparse.Namespace) -> int:
    from fp4sense.inputs.assets import ensure_assets

    paths = ensure_assets()
    if args.json:
        _emit_json({k: str(v) for k, v in paths.items()})
    else:
        for key, path in paths.items():
            print(f"{key:12s} {path}")
    return EXIT_OK


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from fp4sense.inputs.gguf import convert_gguf

    out = convert_gguf(args.gguf, **options.keywords(args, options.CONVERT_GGUF))
    _emit_json({"out": str(out)}) if args.json else print(f"wrote {out}")
    return EXIT_OK


def _cmd_schemes(args: argparse.Namespace) -> int:
    from fp4sense.numerics.schemes import MENU, bits_per_weight

    rows = [{"name": s.name, "weights": s.weight_format or "bf16",
             "activations": s.activations or "16-bit", "block": s.block_size,
             "bits_per_weight_576x1536": round(bits_per_weight(s, (576, 1536)), 5),
             "description": s.description} for s in MENU.values()]
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
    from fp4sense.checkpoint.checks import check_checkpoint, checkpoint_tokenizer
    from fp4sense.evaluation.vllm_check import Tolerance, verify_vllm_many
    from fp4sense.inputs.texts import model_context, protocol_windows

    windows = []
    for folder in args.checkpoint:
        check_checkpoint(folder)  # before the tokenizer: a missing folder is one line
        w = protocol_windows(checkpoint_tokenizer(folder), "evaluation", args.eval_windows,
                             source=text_source(args), raw=args.raw_windows,
                             context=model_context(read_json(
                                 Path(folder) / "config.json", "checkpoint's config",
                                 "restore it from the checkpoint's source")))
        windows.append(w[:, : args.window_tokens])
    limits = (args.max_abs, args.mean_abs, args.ppl_rel)
    tolerance = None if all(v is None for v in limits) else Tolerance(
        *(math.inf if v is None else v for v in limits))
    results = verify_vllm_many(args.checkpoint, windows, prompt=args.prompt,
                               serve_python=args.serve_python, tolerance=tolerance,
                               timeout_s=args.timeout_s)
    if args.json:  # one checkpoint: its object; several: a list of them
        dicts = [r.to_dict() for r in results]
        _emit_json(dicts[0] if len(dicts) == 1 else dicts)
    for i, result in enumerate(results if not args.json else []):
        if i:
            print()
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
    return EXIT_OK if all(r.passed for r in results) else EXIT_VERIFY_FAILED


def _cmd_analyze(args: argparse.Namespace) -> int:
    check_analysis_output(args.out_dir, args.cache,  # before torch
                          local_inputs(args.model or default_model_path(), args.text))
    from fp4sense.api import analyze_model
    from fp4sense.reports.analysis import findings

    report = analyze_model(
        args.model, text=text_source(args), **options.keywords(args, options.ANALYZE),
        progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    from fp4sense.runtime import distributed

    if not distributed.is_main():  # rank 0 speaks for a torchrun launch
        return EXIT_OK
    if args.json:
        _emit_json({"out": str(args.out_dir), "base_ppl": report.base_ppl,
                    "cost": report.cost, "correlations": report.correlations,
                    "findings": findings(report),
                    "unaccounted_weights": report.units.unaccounted,
                    "left_alone": report.units.left_alone, "routing": report.routing})
    else:
        print()
        for line in findings(report):
            print(f"- {line.replace('**', '')}")
    return EXIT_OK


def _distill_settings(args: argparse.Namespace):
    """``--distill STEPS`` (with its mode, learning rate, windows) as DistillSettings."""
    if args.distill is None:
        return None
    from fp4sense.quantization.distill import DistillSettings
    return DistillSettings(args.distill, args.distill_lr, args.distill_lr_4bit,
                           windows=args.distill_windows, holdout=args.distill_holdout,
                           mode=args.distill_mode, backward=args.distill_backward)


def _cmd_quantize(args: argparse.Namespace) -> int:
    guard_output(args.out_dir, overwrite=args.overwrite,  # before torch
                 inputs=local_inputs(args.model or default_model_path(), args.text))
    from fp4sense.api import quantize_model

    result = quantize_model(
        args.model, **options.keywords(args, options.QUANTIZE),
        distill=_distill_settings(args), text=text_source(args), progress=not args.json,
        log=(lambda msg: print(msg, file=sys.stderr)) if args.json else print,
    )
    if "rank" in result:  # another rank of a torchrun launch: rank 0 speaks for the run
        return EXIT_OK
    if args.json:
        _emit_json(result.to_dict())
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

    r = evaluate_checkpoint(args.checkpoint, text=text_source(args),
                            **options.keywords(args, options.EVAL), progress=not args.json)
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
    from fp4sense.publishing.hub import push

    result = push(args.checkpoint, **options.keywords(args, options.PUSH))
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


# name -> (help, arguments, action); the order is the order of `fp4sense --help`
class Command(NamedTuple):
    """One ``fp4sense`` command: what ``--help`` says of it, the function that adds its
    arguments to a parser (every front door calls the same one), and its action."""

    summary: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    action: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "setup": Command("fetch and verify the bundled model and text (offline cache)",
                     setup_args, _cmd_setup),
    "convert-gguf": Command("convert a GGUF model file to an HF safetensors folder",
                            convert_gguf_args, _cmd_convert_gguf),
    "analyze": Command("layer-wise and block-wise FP4 sensitivity of MODEL (measured and/or "
                       "estimated), written as a report", analyze_args, _cmd_analyze),
    "quantize": Command("plan under a budget from FP4 sensitivities and write a "
                        "compressed-tensors checkpoint with llm-compressor", quantize_args,
                        _cmd_quantize),
    "eval": Command("PPL, KL vs base, top-1 agreement and effective bits of a "
                    "compressed-tensors checkpoint", eval_args, _cmd_eval),
    "verify-vllm": Command("check that vLLM loads CHECKPOINT and computes the same log-probs "
                           "as transformers (runs the serve environment)", verify_vllm_args,
                           _cmd_verify_vllm),
    "push": Command("check a checkpoint folder and upload it to the Hugging Face Hub",
                    push_args, _cmd_push),
    "schemes": Command("list the scheme menu with bits per weight", schemes_args,
                       _cmd_schemes),
    "analyze-training": Command("which layers and GEMMs (fprop, dgrad, wgrad) of MODEL can "
                                "train in NVFP4 / MXFP4: estimated and measured, a policy "
                                "under a BF16 budget, exports for TE, Megatron, torchao, "
                                "torchtitan", analyze_training_args, run_analyze_training),
    "train-trial": Command("train the arms bf16, all-fp4, nvidia-rule and policy of a "
                           "training policy from one start and compare held-aside losses",
                           train_trial_args, run_train_trial),
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
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.summary, description=command.summary)
        command.add_arguments(p)
        p.set_defaults(func=command.action)
    return parser


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of an error users can fix (:class:`fp4sense.validate.UserError`, or
    a plain ValueError: a bad value from code we call), None for anything else."""
    if isinstance(exc, UserError):
        return exc.exit_code
    return EXIT_USER_ERROR if isinstance(exc, ValueError) else None


def run_command(action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command; map the errors users can fix to one line and an exit code."""
    try:
        with sigterm_as_interrupt(), _stdout_for_json(bool(getattr(args, "json", False))):
            return int(action(args))
    except KeyboardInterrupt as exc:
        settle_interrupt(exc)
        print(interrupt_line(exc), file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    except Exception as exc:
        code = _exit_code(exc)
        if code is not None:
            print(f"fp4sense: error: {exc}", file=sys.stderr)
            return code
        if not isinstance(exc, OSError) and "StorageFull" not in str(exc):
            raise  # (safetensors' error on a full disk is no OSError: Rust's StorageFull)
        # a disk that fills or turns read-only mid-run: one line
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"fp4sense: error: could not read or write {where}"
              f"{getattr(exc, 'strerror', None) or exc}; "
              "free space or fix permissions and run again", file=sys.stderr)
        return EXIT_USER_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    code = EXIT_INTERRUPTED
    try:
        code = run_command(args.func, args)
        return code
    finally:
        distributed = sys.modules.get("fp4sense.runtime.distributed")
        if distributed is not None:  # never imported: no process group to leave
            distributed.leave(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
