"""fp4sense's benchmarks: one module per experiment, each with ``add_args(parser)`` and
``run(args) -> int``, run as ``python -m bench NAME`` from the repository's root (in the
quantize environment: ``.venv/bin/python -m bench NAME``). ``harness`` holds what they
share (results folder, menus, resumable records, the protocol session, the judge, peak
memory, verify-vllm); results go to bench/results, each recording the command that made
it. Results written before 0.6 record ``python bench/NAME.py ...``: the same run is now
``python -m bench NAME ...``.

Experiments: analysis, analysis_memory, bf16_speed, calibration_dtype, gptq_scores,
import_time, input_clip, moe, moe_serve, paper_estimate, plan_select, plans, qad_backward,
qad_lr, ranks, rotation, scale_search, scaling, smollm2_moe, stack, stack_table, training,
training_noise, training_scaling.
"""

from __future__ import annotations

import pkgutil


def experiments() -> list[str]:
    """Every benchmark module (all but the harness)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if m.name not in ("harness",) and not m.name.startswith("_"))
