"""Benchmark: `fp4sense analyze` on the bundled SmolLM2 per protocol.md.

Phases (NVFP4 and MXFP4, 8 calibration windows of 512 tokens, float32 on CPU):

1. measured component + block views: wall time, block forwards spent vs the naive count
   (every perturbation a full-model run);
2. estimated mode, all views including the full grid: wall time (one forward + backward
   per window);
3. measured grid for a subset of blocks, and the Spearman rank correlation of the
   estimated grid with it (and of every other view both modes cover).

Peak RSS of the whole process is reported. Results: bench/results/analysis.json, and
the report with its plots in bench/results/analysis/. Resumable: finished entries are
cached in bench/results/.analysis-cache (``--fresh`` starts over); a phase that reused
cached entries has its time marked as not measured.

    .venv/bin/python -m bench analysis

Caveat: SmolLM2's released weights were Q4_1-quantized before we got them.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

from bench.harness import RESULTS, command, peak_rss_gib

GRID_BLOCKS = [0, 1, 2, 11, 15, 27, 28, 29]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemes", default="NVFP4,MXFP4")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--grid-blocks", default=",".join(map(str, GRID_BLOCKS)))
    parser.add_argument("--out", type=Path, default=RESULTS / "analysis.json")
    parser.add_argument("--report-dir", type=Path, default=RESULTS / "analysis")
    parser.add_argument("--cache", type=Path, default=RESULTS / ".analysis-cache")
    parser.add_argument("--fresh", action="store_true", help="drop the bench cache first")


def run(args: argparse.Namespace) -> int:
    import torch

    from fp4sense.api import BUNDLED_MODEL_NOTE, analysis_windows, load_model
    from fp4sense.diagnosis import analyze, correlations
    from fp4sense.reports.analysis import findings, write_analysis

    torch.manual_seed(0)
    if args.fresh and args.cache.exists():
        shutil.rmtree(args.cache)
    schemes = args.schemes.split(",")
    grid_blocks = [int(b) for b in args.grid_blocks.split(",")]
    model, tokenizer, _ = load_model(None)
    windows = analysis_windows(tokenizer, None, args.windows, args.tokens)
    text = {"source": "protocol calibration split"}

    phases = {}
    reports = {}
    for name, views, modes, blocks in (
        ("measured_component_block", ["component", "block"], ["measured"], None),
        ("estimated_all_views", ["component", "block", "grid"], ["estimated"], None),
        ("measured_grid_subset", ["grid"], ["measured"], grid_blocks),
    ):
        t = time.perf_counter()
        report = analyze(model, windows, schemes=schemes, views=views, modes=modes,
                         grid_blocks=blocks, cache_dir=args.cache, text=text)
        wall = time.perf_counter() - t
        c = report.cost
        phases[name] = {
            "views": views, "modes": modes, "grid_blocks": blocks,
            "wall_s": round(wall, 1), "timed": c["cached_entries"] == 0,
            "measured_block_forwards": c.get("measured_block_forwards"),
            "naive_block_forwards": c.get("naive_block_forwards"),
            "entries": len(report.entries),
        }
        reports[name] = report
        print(f"{name}: {wall:.0f} s, {len(report.entries)} entries", flush=True)

    # one report holding every entry (the three phases share model, text and cache)
    merged = reports["measured_component_block"]
    merged.entries = [e for r in reports.values() for e in r.entries]
    merged.cost = {"phases": phases}
    merged.correlations = correlations(merged)
    write_analysis(merged, args.report_dir, notes=[BUNDLED_MODEL_NOTE])

    result = {
        "command": command("analysis", args.argv),
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "windows": args.windows, "window_tokens": args.tokens, "schemes": schemes,
        "base_ppl": merged.base_ppl,
        "peak_rss_gib": round(peak_rss_gib(), 3),
        "phases": phases,
        "correlations": merged.correlations,
        "findings": findings(merged),
        "caveat": BUNDLED_MODEL_NOTE,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("peak_rss_gib", "phases", "correlations")},
                     indent=2))
    return 0

