"""Peak memory of `fp4sense analyze` on SmolLM2 (protocol: 8 windows × 512 tokens).

Runs, without the cache (so every structure is built), what the analysis holds at its
largest: the base model's block outputs and log-probs, the fake-quantized weights of
every unit for NVFP4 and MXFP4 (component view), the fully quantized model's block
outputs that protect runs replay (whole-model entry), and the estimated pass. Prints the
process's peak resident set size.

    .venv/bin/python -m bench analysis_memory
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from bench.harness import RESULTS, command


def add_args(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    from fp4sense.api import analysis_windows, load_model
    from fp4sense.diagnosis import analyze
    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.diagnosis.views import REPORT_VIEWS
    from fp4sense.structure.units import find_units

    t = time.perf_counter()
    model, tok, _ = load_model(None)
    windows = analysis_windows(tok, None, 8, 512)
    analyze(model, windows, schemes=["NVFP4", "MXFP4"], views=["component"],
            modes=["measured", "estimated"], cache_dir=None, progress=False,
            log=lambda m: None)
    units = find_units(model)
    run = Analysis(model, windows, units, EntryCache(None), progress=False)
    for scheme in ("NVFP4", "MXFP4"):  # whole model + its replayable outputs
        (_, members), = REPORT_VIEWS["model"].targets(units, None)
        run.quantized_outputs(scheme, {m: (u, scheme) for u, mods in members for m in mods})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out = {"command": command("analysis_memory", args.argv), "peak_rss_gib": round(peak, 3),
           "windows": 8, "window_tokens": 512, "seconds": round(time.perf_counter() - t)}
    (RESULTS / "analysis_memory.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0

