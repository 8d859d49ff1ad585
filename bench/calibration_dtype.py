"""Benchmark: `fp4sense quantize` calibrating in float32 against bfloat16, in one run.

On the bundled SmolLM2 per protocol.md, the default menu {NVFP4, FP8_DYNAMIC, BF16} at
5.0 bits, three runs, each in a process of its own that reports its wall time, the
oneshot's share and its peak resident memory (VmHWM):

- ``float32``: `quantize` as a user runs it on a CPU (estimate, oneshot in float32);
- ``float32-given``: the same with that run's sensitivity report given (no estimate):
  its checkpoint must be the first one's, byte for byte;
- ``bfloat16``: that report given, the oneshot in bfloat16: the same plan, so the two
  given-report runs differ only in the dtype the oneshot calibrates in.

The ``float32`` and ``bfloat16`` checkpoints are evaluated from disk per protocol
(float32, the first 16 evaluation windows) and verified in vLLM (``--verify``). The
result names whether this CPU has native bfloat16 (AVX512-BF16 / AMX): the time ratio
depends on it.

    .venv/bin/python -m bench calibration_dtype [--verify]

Results: bench/results/calibration_dtype.json (``--out``: one file per kind of CPU, e.g.
calibration_dtype_avx2.json from one without native bfloat16). Run it alone: the two
oneshots compete for the cores with anything else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import REPO, RESULTS, child, command, peak_rss_gib, verify_vllm

BUDGET = 5.0


def one(dtype: str, out: Path, sensitivity: str | None) -> dict:
    """`quantize` of the bundled model in ``dtype`` (no evaluation), in this process."""
    from fp4sense.api import quantize_model

    t = time.perf_counter()
    result = quantize_model(None, out_dir=out, budget_bits=BUDGET, dtype=dtype,
                            sensitivity=sensitivity, evaluate=False, overwrite=True,
                            progress=False, log=lambda m: print(m, file=sys.stderr))
    return {"dtype": dtype, "wall_s": round(time.perf_counter() - t, 1),
            "timings": result["timings"], "peak_rss_gib": round(peak_rss_gib(), 3),
            "schemes": result["plan"]["schemes"], "folder": out.name}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--work", type=Path, default=RESULTS / ".calibration-dtype")
    ap.add_argument("--out", type=Path, default=RESULTS / "calibration_dtype.json",
                    help="the result (one per kind of CPU: native bf16 or not)")
    ap.add_argument("--verify", action="store_true", help="verify-vllm both checkpoints")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one dtype
    ap.add_argument("--sensitivity", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.one:
        print(json.dumps(one(args.one, args.work / args.one, args.sensitivity)))
        return 0

    rows = []
    report = str(args.work / "float32" / "float32" / "sensitivity.json")  # label / dtype
    for label, dtype, given in (("float32", "float32", None),
                                ("float32-given", "float32", report),
                                ("bfloat16", "bfloat16", report)):
        cmd = child("calibration_dtype", "--one", dtype, "--work", str(args.work / label))
        if given:
            cmd += ["--sensitivity", given]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=REPO)
        rows.append({"run": label, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    folders = {r["run"]: args.work / r["run"] / r["dtype"] for r in rows}

    from fp4sense.jobs.evaluate import evaluate_checkpoint
    from fp4sense.runtime.devices import cpu_has_native_bf16

    same_bytes = ((folders["float32"] / "model.safetensors").read_bytes()
                  == (folders["float32-given"] / "model.safetensors").read_bytes())
    judged = [r for r in rows if r["run"] != "float32-given"]
    for row in judged:
        e = evaluate_checkpoint(folders[row["run"]], base=None, eval_windows=16,
                                progress=False, log=lambda m: None)
        row.update({k: e[k] for k in ("effective_bits", "kl", "kl_se", "ppl", "top1")})
    plans = [json.loads((folders[r["run"]] / "plan.json").read_text())["choices"]
             for r in rows]
    f32, given, bf16 = rows
    result = {"command": command("calibration_dtype", args.argv),
              "cpu_native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads(),
              "budget_bits": BUDGET, "rows": rows,
              "same_plan": all(p == plans[0] for p in plans),
              "float32_given_report_same_checkpoint_bytes": same_bytes,
              "oneshot_bf16_over_f32": round(bf16["timings"]["oneshot_s"]
                                             / given["timings"]["oneshot_s"], 2),
              "peak_rss_bf16_over_f32": round(bf16["peak_rss_gib"] / given["peak_rss_gib"], 2),
              "kl_difference": bf16["kl"] - f32["kl"],
              "kl_difference_within_se": abs(bf16["kl"] - f32["kl"])
              <= max(f32["kl_se"], bf16["kl_se"])}
    if args.verify:
        verdicts, tail = verify_vllm([folders[r["run"]] for r in judged])
        result["verify_vllm"] = {r["run"]: "PASS" if verdicts[folders[r["run"]].name]["passed"]
                                 else "FAIL" for r in judged
                                 if folders[r["run"]].name in verdicts} or tail
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0

