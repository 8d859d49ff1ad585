"""Ranks on this machine: the estimated analysis of the bundled SmolLM2 (8 windows x 512
tokens, NVFP4 and MXFP4, the grid) with 1 process and with ``torchrun`` 2 ranks (gloo),
same run, no cache; wall time ratio and whether the reports agree entry for entry.

    .venv/bin/python -m bench ranks

On 2 cores a second rank cannot add compute: 1 process already uses both cores through
torch's threads; the 2-rank run gives each rank one thread (OMP_NUM_THREADS=1). What it
shows is the cost of splitting (each rank loads the model and runs the base pass).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, command

FP4SENSE = str(Path(sys.executable).parent / "fp4sense")
ARGS = ["analyze", "--mode", "estimated", "--views", "grid", "--schemes", "NVFP4,MXFP4",
        "--analysis-windows", "8", "--no-cache", "--no-plots", "--json"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(ranks: int, out: Path) -> float:
    env = dict(os.environ)
    if ranks == 1:
        cmd = [FP4SENSE, *ARGS, "--out", str(out)]
    else:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={_port()}", "-m", "fp4sense", *ARGS, "--out", str(out)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return time.perf_counter() - t


def add_args(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="fp4sense-ranks-"))
    one = timed(1, work / "one")
    two = timed(2, work / "two")
    a = json.loads((work / "one" / "sensitivity.json").read_text())["entries"]
    b = json.loads((work / "two" / "sensitivity.json").read_text())["entries"]
    worst = max(abs(x["kl"] - y["kl"]) / abs(x["kl"]) for x, y in zip(a, b, strict=True))
    result = {"command": command("ranks", args.argv), "cpus": os.cpu_count(),
              "one_rank_s": round(one, 1), "two_ranks_s": round(two, 1),
              "two_over_one": round(two / one, 2), "same_entries": a == b,
              # 2 threads vs 1 thread per rank: matmuls may sum in another order
              "max_relative_kl_difference": worst}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ranks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0

