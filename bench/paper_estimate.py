"""Paper estimate (no GPU run behind it yet): time and memory of analyzing
Llama-3.1-8B and Llama-3.1-70B on 1 and 8 GPUs, from FLOP and byte counts of what
fp4sense does, under the assumptions printed with the table. Replace with a measured run
(scripts/gpu_check.sh on the bundled model; the same path on these models) when one is made.

Calibration: the FLOPs of the 1.5B analysis in bench/results/scaling.json divided by its
wall time, against this machine's measured float32 matmul peak, give the fraction of peak
the analysis reaches (hooks, fake quantization, Python); the GPU estimate assumes the same
fraction of the GPU's bf16 peak.

    .venv/bin/python -m bench scaling && .venv/bin/python -m bench paper_estimate
"""

from __future__ import annotations

import argparse
import json

from bench.harness import RESULTS, command

MODELS = {  # public configs: layers, hidden, intermediate, kv heads x head_dim, vocab
    "Llama-3.1-8B": dict(layers=32, hidden=4096, inter=14336, kv=8 * 128, vocab=128256),
    "Llama-3.1-70B": dict(layers=80, hidden=8192, inter=28672, kv=8 * 128, vocab=128256),
}
ASSUME = {
    "gpu_bf16_peak_flops": 989e12,  # H100 / H200 SXM dense bf16 (datasheet)
    "gpu_memory_gib": 80,      # the smaller of the two (H100); H200 has 141
    "disk_gb_s": 2.0,          # NVMe read of safetensors blocks (--low-memory)
    "windows": 8, "tokens": 512,  # the protocol's analysis windows
    "calib_windows": 32,       # quantize's calibration windows
    "schemes": 2,              # NVFP4 and MXFP4
    "component_kinds": 4,      # Llama units: qkv, o, gate+up, down
}


def block_linear_params(m: dict) -> int:
    h, i, kv = m["hidden"], m["inter"], m["kv"]
    return h * h * 2 + 2 * h * kv + 3 * h * i


def cpu_peak_flops() -> float:
    """This machine's float32 matmul rate (the best of a few 2048^3 products)."""
    import time

    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * 2048**3 / (time.perf_counter() - t))
    return best


def calibration() -> dict:
    """Fraction of peak the analysis reached in the scaling benchmark (largest model)."""
    scaling = json.loads((RESULTS / "scaling.json").read_text())
    tokens = scaling["windows"] * scaling["tokens"]
    peak = cpu_peak_flops()
    out = {"cpu_peak_gflops": round(peak / 1e9, 1)}
    for mode, forwards in (("estimated", 4 + 1), ("measured", 4 + 1)):
        row = [r for r in scaling["rows"] if r["mode"] == mode and r["low_memory"]][-1]
        flops = forwards * 2 * row["params_b"] * 1e9 * tokens
        out[f"{mode}_fraction_of_peak"] = round(flops / row["wall_s"] / peak, 3)
    return out


def estimate(name: str, m: dict, gpus: int, fraction: dict) -> dict:
    a = ASSUME
    tokens = a["windows"] * a["tokens"]
    per_block = block_linear_params(m)
    params = m["layers"] * per_block + 2 * m["vocab"] * m["hidden"]
    weights_gb = params * 2 / 1e9
    fits = weights_gb * 1.2 < a["gpu_memory_gib"] * 1.074  # 20% room for activations
    fwd = 2 * params * tokens  # FLOPs of one forward over the windows
    # estimated mode: forward + backward (3 fwd) + the streamed recompute (1) + one
    # quantized matmul per linear per scheme on the backward (schemes x 1 fwd)
    est_flops = fwd * (4 + a["schemes"]) / gpus  # windows split across ranks
    est_io = 0 if fits else 2 * weights_gb / a["disk_gb_s"]  # blocks read twice
    # measured mode (component + block views): per scheme, kinds + isolate (L/2 on
    # average: replay from the block) + protect (L) + the whole model, full forwards
    runs = a["schemes"] * (a["component_kinds"] + 1.5 * m["layers"] + 1)
    meas_flops = runs * fwd / gpus
    meas_io = 0 if fits else runs * weights_gb / a["disk_gb_s"] / gpus
    hidden_bytes = tokens * m["hidden"] * 2
    return {
        "model": name, "gpus": gpus, "params_b": round(params / 1e9, 1),
        "weights_gb_bf16": round(weights_gb, 1), "fits_one_gpu": fits,
        # reading the weights once (loading, or the first streamed pass) comes on top
        "load_s": round(weights_gb / a["disk_gb_s"]),
        "estimated_s": round(est_flops / (a["gpu_bf16_peak_flops"]
                                          * fraction["estimated_fraction_of_peak"]) + est_io),
        "measured_s": round(meas_flops / (a["gpu_bf16_peak_flops"]
                                          * fraction["measured_fraction_of_peak"]) + meas_io),
        "estimate_cpu_cache_gib": round(
            m["layers"] * hidden_bytes / gpus / 2**30, 1),  # streamed block inputs
        "measured_replay_gib": round(2 * m["layers"] * hidden_bytes / 2**30, 1),
        "gpu_memory_gib": round((weights_gb if fits else per_block * 2 / 1e9) * 1.2, 1),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    fraction = calibration()
    rows = [estimate(n, m, g, fraction) for n, m in MODELS.items() for g in (1, 8)]
    out = {"command": command("paper_estimate", args.argv), "assumptions": ASSUME,
           "calibration": fraction, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "paper_estimate.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0

