"""Benchmark addendum: SmolLM2-MoE (top-6 of 8 experts, ``bench/smollm2_moe.py``) in
uniform NVFP4A16, written by `fp4sense quantize` and served by vLLM on the CPU through
fp4sense's NVFP4A16 fused-MoE experts (`fp4sense verify-vllm`). The NVFP4 (W4A4) row is
in ``bench/moe.py``.

    .venv/bin/python bench/moe_serve.py [--work DIR]

Results: bench/results/moe_serve.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from moe import RESULTS, checkpoint_check
    from smollm2_moe import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="fp4sense-moe-"))
    folder = work / "smollm2-moe-top6"
    if not (folder / "model.safetensors").is_file():
        build(folder, 6)
    result = {"model": "SmolLM2-MoE, top-6 of 8 experts",
              "NVFP4A16": checkpoint_check(folder, work, "NVFP4A16")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_serve.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
