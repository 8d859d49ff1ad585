"""Benchmark: how long ``import fp4sense.api`` takes, against the eager import 0.5's api
made (the stage modules its functions live in: diagnosis, the quantize pipeline, eval,
the model inputs), in one run, each in a fresh interpreter, median of ``--repeats``.

    .venv/bin/python -m bench import_time

Results: bench/results/import_time.json. Run it alone: import time is disk and CPU bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from bench.harness import RESULTS, command

CASES = {
    "lazy: import fp4sense.api": "import fp4sense.api",
    "eager (0.5's api): its stage modules": (
        "import fp4sense.jobs.analyze, fp4sense.jobs.quantize, "
        "fp4sense.jobs.evaluate, fp4sense.inputs.models"),
    "first use: fp4sense.api.analyze_model": (
        "import fp4sense.api; fp4sense.api.analyze_model"),
}


def seconds(statement: str) -> float:
    code = ("import time; t = time.perf_counter(); " + statement
            + "; print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return float(done.stdout.strip().splitlines()[-1])


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> int:
    seconds("import fp4sense.api, fp4sense.jobs.quantize")  # warm the file cache
    rows = {name: round(statistics.median(seconds(code) for _ in range(args.repeats)), 3)
            for name, code in CASES.items()}
    lazy, eager = rows["lazy: import fp4sense.api"], rows[
        "eager (0.5's api): its stage modules"]
    result = {"command": command("import_time", args.argv), "repeats": args.repeats,
              "median_s": rows, "eager_over_lazy": round(eager / lazy, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "import_time.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0

