"""Benchmark: `fp4sense quantize` calibrating in float32 against bfloat16, in one run.

On the bundled SmolLM2 per protocol.md, the default menu {NVFP4, FP8_DYNAMIC, BF16} at
5.0 bits: one `quantize --dtype float32` (the CPU default: estimate, oneshot and
evaluation in float32), then `quantize --dtype bfloat16` applying the same sensitivity
report (so both apply the same plan and differ only in the dtype the oneshot calibrates
in). Each runs in a process of its own, which reports its wall time, the oneshot's share
and its peak resident memory (VmHWM); both checkpoints are then evaluated from disk per
protocol (float32, the first 16 evaluation windows) and can be verified in vLLM
(``--verify``).

    .venv/bin/python bench/calibration_dtype.py [--verify]

Results: bench/results/calibration_dtype.json. Run it alone: the two oneshots compete
for the cores with anything else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BUDGET = 5.0


def peak_rss_gib() -> float:
    """This process's own high-water mark (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 2**20, 3)
    raise RuntimeError("no VmHWM in /proc/self/status")


def one(dtype: str, out: Path, sensitivity: str | None) -> dict:
    """`quantize` of the bundled model in ``dtype`` (no evaluation), in this process."""
    from fp4sense.api import quantize_model

    t = time.perf_counter()
    result = quantize_model(None, out_dir=out, budget_bits=BUDGET, dtype=dtype,
                            sensitivity=sensitivity, evaluate=False, overwrite=True,
                            progress=False, log=lambda m: print(m, file=sys.stderr))
    return {"dtype": dtype, "wall_s": round(time.perf_counter() - t, 1),
            "timings": result["timings"], "peak_rss_gib": peak_rss_gib(),
            "schemes": result["plan"]["schemes"], "folder": out.name}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=RESULTS / ".calibration-dtype")
    ap.add_argument("--verify", action="store_true", help="verify-vllm both checkpoints")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one dtype
    ap.add_argument("--sensitivity", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.work / args.one, args.sensitivity)))
        return 0

    rows = []
    for dtype in ("float32", "bfloat16"):
        cmd = [sys.executable, __file__, "--one", dtype, "--work", str(args.work)]
        if dtype != "float32":  # the same plan: the float32 run's report
            cmd += ["--sensitivity", str(args.work / "float32" / "sensitivity.json")]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)

    from fp4sense.evaluation.evaluate import evaluate_checkpoint

    for row in rows:
        e = evaluate_checkpoint(args.work / row["dtype"], base=None, n_windows=16,
                                progress=False, log=lambda m: None)
        row.update({k: e[k] for k in ("effective_bits", "kl", "kl_se", "ppl", "top1")})
    plan = [json.loads((args.work / r["dtype"] / "plan.json").read_text())["choices"]
            for r in rows]
    result = {"command": "python bench/calibration_dtype.py" + (" --verify" if args.verify
                                                                else ""),
              "budget_bits": BUDGET, "rows": rows, "same_plan": plan[0] == plan[1],
              "oneshot_bf16_over_f32": round(rows[1]["timings"]["oneshot_s"]
                                             / rows[0]["timings"]["oneshot_s"], 2),
              "kl_difference": rows[1]["kl"] - rows[0]["kl"],
              "kl_difference_within_se": abs(rows[1]["kl"] - rows[0]["kl"])
              <= max(rows[0]["kl_se"], rows[1]["kl_se"])}
    if args.verify:
        exe = str(Path(sys.executable).parent / "fp4sense")
        proc = subprocess.run([exe, "verify-vllm", "--json",
                               *[str(args.work / r["dtype"]) for r in rows]],
                              capture_output=True, text=True)
        found = json.loads(proc.stdout) if proc.stdout.strip() else []
        result["verify_vllm"] = {Path(r["checkpoint"]).name: "PASS" if r["passed"] else "FAIL"
                                 for r in found} or proc.stderr[-400:]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "calibration_dtype.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
