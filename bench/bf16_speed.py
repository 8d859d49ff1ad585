"""Benchmark: how much slower this machine multiplies bfloat16 matrices than float32 ones.

llm-compressor's oneshot (the calibration passes of `fp4sense quantize`) runs the model in
bfloat16; fp4sense's estimate, evaluation and QAD run float32. On a CPU without native
bfloat16 the former are several times slower, which sets what a written-checkpoint row
of the benchmarks costs here. One SmolLM2-sized linear (576 -> 1536, 2048 tokens), the
median of 20 timings per dtype, on all the threads torch uses.

    .venv/bin/python -m bench bf16_speed

Results: bench/results/bf16_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.harness import RESULTS, command


def seconds(dtype: torch.dtype, repeat: int) -> float:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 576, generator=gen).to(dtype)
    w = torch.randn(1536, 576, generator=gen).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=20, help="timings per dtype")


def run(args: argparse.Namespace) -> int:
    f32 = seconds(torch.float32, args.repeat)
    bf16 = seconds(torch.bfloat16, args.repeat)
    result = {"command": command("bf16_speed", args.argv), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "shape": [2048, 576, 1536],
              "float32_s": f32, "bfloat16_s": bf16, "bf16_over_f32": bf16 / f32}
    (RESULTS / "bf16_speed.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0

